"""The hf engine's scheduler: generations prefilled a chunk at a time, and decoded together, one forward step for all.

A request joins at the next step. Every step feeds each generating sequence its last token in one forward
(`hfcache.forward_rows`: the weights are read once for all rows, and each row attends over its own cache) and samples
each one's next token from its row; then it feeds one prefilling sequence the next PREFILL_CHUNK tokens of its prompt
(a cached prefix is in its cache already), so a long prompt delays the others' next tokens by a chunk at a time,
never by its whole prefill. The sequence fed is the one with the fewest prompt tokens left: a hit's few uncached
tokens go in at the next step, never behind a miss's whole prefill. A sequence whose prompt is in samples its first
token and joins the batch; a finished one leaves at once and a waiting one takes its place, up to `parallel` at a
time. The scheduler runs on the process's compute thread (service.runtime.threads) while it has work and gives the
thread back when idle. A request of several choices (`n` > 1), or a model whose attention is not routed through hfcache,
runs alone between steps (`ModelRunner.generate`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from service.engines.generation import Generation, GenRequest
from service.engines.hf import hfcache
from service.engines.hf.runner import Live, ModelRunner
from service.runtime import threads

log = logging.getLogger("kvstash.hf")

PREFILL_CHUNK = 128  # prompt tokens a step feeds one prefilling sequence


@dataclass
class _Job:
    request: GenRequest
    alone: bool  # run whole by ModelRunner.generate, between steps
    done: threading.Event = field(default_factory=threading.Event)
    live: Live | None = None
    result: Generation | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What the scheduler did: forward steps of the batch, and the sequences they fed in all."""

    steps: int = 0
    rows: int = 0
    widest: int = 0  # the most sequences one step fed


def _left(job: _Job) -> int:
    """Prompt tokens not yet in `job`'s cache."""
    assert job.live is not None
    return len(job.live.prompt) - job.live.fed


class DecodeBatcher:
    """Decodes up to `parallel` of `runner`'s generations together; `generate` may be called from many threads."""

    def __init__(self, runner: ModelRunner, parallel: int) -> None:
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.runner = runner
        self.parallel = parallel
        self.batched = hfcache.batches_rows(runner.model)
        self.stats = BatchStats()
        self._lock = threading.Lock()
        self._waiting: deque[_Job] = deque()
        self._live: list[_Job] = []  # generating
        self._prefilling: list[_Job] = []  # begun, prompt not all in yet
        self._running = False

    def generate(self, request: GenRequest) -> Generation:
        """As ModelRunner.generate; blocks until done (the KV is copied out on the calling thread)."""
        if threads.on_compute_thread():  # called from the scheduler's own thread: nothing else can run meanwhile
            return self.runner.generate(request)
        job = _Job(request, alone=not self.batched or request.params.n != 1)
        with self._lock:
            self._waiting.append(job)
            start, self._running = not self._running, True
        if start:
            threads.compute_executor().submit(self._run)
        job.done.wait()
        if job.error is not None:
            raise job.error
        if job.result is not None:
            return job.result
        assert job.live is not None
        return self.runner.finish(job.live)

    def waiting(self) -> int:
        """Generations sent and not yet begun."""
        with self._lock:
            return len(self._waiting)

    # -- on the compute thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                admit: list[_Job] = []
                while self._waiting and len(self._live) + len(self._prefilling) + len(admit) < self.parallel:
                    admit.append(self._waiting.popleft())
                if not admit and not self._live and not self._prefilling:
                    self._running = False
                    return
            for job in admit:
                self._begin(job)
            if self._live:
                self._step()
            if self._prefilling:
                self._prefill(min(self._prefilling, key=_left))

    def _begin(self, job: _Job) -> None:
        try:
            if job.alone:
                job.result = self.runner.generate(job.request)
            else:
                job.live = self.runner.begin(job.request)
                self._prefilling.append(job)
                return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            job.error = exc
        job.done.set()

    def _prefill(self, job: _Job) -> None:
        assert job.live is not None
        try:
            if not self.runner.prefill(job.live, PREFILL_CHUNK):
                return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            self._prefilling.remove(job)
            job.error = exc
            job.done.set()
            return
        self._prefilling.remove(job)
        if job.live.done:
            job.done.set()
        else:
            self._live.append(job)

    def _step(self) -> None:
        jobs = list(self._live)
        lives = [job.live for job in jobs if job.live is not None]
        try:
            logits = self.runner.step(lives)
        except Exception as exc:  # never leave a caller waiting: fail what is in flight
            log.exception("hf batched step failed")
            for job in jobs:
                self._end(job, RuntimeError(f"generation failed: {exc}"))
            return
        self.stats.steps += 1
        self.stats.rows += len(lives)
        self.stats.widest = max(self.stats.widest, len(lives))
        for job, live, row in zip(jobs, lives, logits, strict=True):
            try:
                self.runner.take(live, row)
            except BaseException as exc:  # noqa: BLE001 - the client went away (its callback raised)
                self._end(job, exc)
                continue
            if live.done:
                self._end(job, None)

    def _end(self, job: _Job, error: BaseException | None) -> None:  # a generating job
        self._live.remove(job)
        job.error = error
        job.done.set()
