"""A pod killed mid-run and started again (`kvstash bench load --restart-pod-at`).

At a moment of the run (seconds after its start, or once a share of all planned turns is done) the pod that
has served the most turns so far gets SIGKILL, as an OOM kill or a node loss would, and is started again on
the same port. Behind sticky routing its sessions come back to an empty pod; behind round robin with kvstash
their KV is in Redis. The report says when it happened, so the turns after it can be told apart.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RestartAt:
    """When to restart: `seconds` after the run starts, or once `fraction` of the planned turns are done."""

    seconds: float | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> RestartAt:
        """`30` or `30s`: seconds into the run; `40%`: once 40% of all planned turns have finished."""
        value = text.strip().lower()
        try:
            if value.endswith("%"):
                fraction = float(value[:-1]) / 100
                if not 0 < fraction < 1:
                    raise ValueError
                return cls(fraction=fraction)
            seconds = float(value.removesuffix("s"))
            if seconds < 0 or not math.isfinite(seconds):
                raise ValueError
            return cls(seconds=seconds)
        except ValueError:
            raise ValueError(f"--restart-pod-at takes seconds (30, 30s) or a share of the turns (40%), "
                             f"not {text!r}") from None

    def describe(self) -> str:
        return f"{self.seconds:g} s into the run" if self.seconds is not None else f"{self.fraction:.0%} of the turns"


class PodRestarter:
    """Watches the turns of one run and restarts its busiest pod once, at the planned moment (a thread)."""

    def __init__(self, when: RestartAt, pods: list[Any], planned_turns: int, started: float) -> None:
        self.when = when
        self._pods = {p.name: p for p in pods}
        self._started = started
        self._target = math.ceil((when.fraction or 0) * planned_turns)
        self._lock = threading.Lock()
        self._served: Counter[str] = Counter()
        self._done = 0
        self._trigger = threading.Event()
        self._stop = threading.Event()
        self.report: dict[str, Any] = {"planned": when.describe(), "done": False}
        self._thread = threading.Thread(target=self._run, name="kvstash-bench-restart", daemon=True)

    def start(self) -> PodRestarter:
        self._thread.start()
        return self

    def turn_done(self, pod: str) -> None:
        """Called by the session threads after every answered turn, with the pod that served it."""
        with self._lock:
            self._served[pod] += 1
            self._done += 1
            if self.when.fraction is not None and self._done >= self._target:
                self._trigger.set()

    def finish(self) -> dict[str, Any]:
        """The run is over: a restart not yet begun never happens; one under way is waited for."""
        self._stop.set()
        self._trigger.set()
        self._thread.join()
        return self.report

    def _run(self) -> None:
        if self.when.seconds is not None:
            self._trigger.wait(max(0.0, self._started + self.when.seconds - time.monotonic()))
        else:
            self._trigger.wait()
        if self._stop.is_set():
            return
        with self._lock:
            busiest = [name for name, _ in self._served.most_common()] + sorted(self._pods)
            turns_done = self._done
        pod = self._pods[busiest[0]]
        killed_at = time.monotonic()
        pod.kill()  # SIGKILL: no drain, no goodbye, whatever it was writing is lost
        if pod.log_path is not None:
            pod.log_path.unlink(missing_ok=True)
        self.report.update(done=True, pod=pod.name, turns_done_at_kill=turns_done,
                           killed_at_s=killed_at - self._started)
        try:
            pod.start()  # the same port: the balancer's upstream list does not change
            pod.wait_ready()
        except Exception as exc:  # noqa: BLE001 - reported; the other pods carry the rest of the run
            self.report["error"] = f"{type(exc).__name__}: {exc}"
            return
        self.report["ready_at_s"] = time.monotonic() - self._started
