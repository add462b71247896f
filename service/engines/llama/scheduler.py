"""The llamacpp engine's scheduler thread: one llama.cpp context of `parallel` sequences, decoded together.

Every step builds one batch with the next token of each sequence that is generating and pieces of the prompts of the
sequences that are prefilling, runs one `llama_decode`, and samples each sequence's next token. A request that
arrives while others generate joins the next step; a finished or abandoned one frees its sequence at once. A
request's cached prefix enters its sequence as llama.cpp sequence state when it is admitted.

Prompts are fed shortest remainder first, in pieces of at most `prefill_chunk` tokens, and a step takes a piece
only where it fits whole in that many prompt tokens: a hit's few uncached tokens go in the next step without a miss's
piece beside them, and no step (so no wait for one) is longer than one piece's. While other sequences decode, a long
prompt (one its next piece does not finish) leaves them DECODE_SHARE of the time: after a step with its piece, decode
steps without one follow for a third of that step's time, so a miss's prefill neither stalls the replies beside it
nor waits long for them. With flash attention off, a prompt's logits are the same bits however it is split (tested),
and a piece of 32 costs little more per token than one of 512; with it on, llama.cpp's attention rounds a piece
under 128 differently and runs it slower, so pieces are 128, and a reply beside others can still differ from one
alone in a near tie (as in llama-server, which batches prompts too).
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from service.engines.generation import GenParams, PrefillHook, TextStream
from service.engines.llama import llamastate
from service.engines.sampling import Sampler
from service.runtime import threads as torch_threads
from service.runtime.contextpool import IdlePool

log = logging.getLogger("kvstash.llamacpp")

N_BATCH = 512  # tokens per llama_decode call
PREFILL_CHUNK = 128  # prompt tokens a step holds at most: a step, and so a wait for one, stays short
PREFILL_CHUNK_NO_FLASH = 32  # with flash attention off, where llama.cpp runs a small piece about as fast per token
DECODE_SHARE = 0.25  # of a pod's time, at least, for decode steps while a long prompt prefills beside them


def prefill_chunk(flash_attn: str) -> int:
    """Prompt tokens a step holds for a context with this flash attention setting (resolved: "on" or "off")."""
    return PREFILL_CHUNK_NO_FLASH if flash_attn == "off" else PREFILL_CHUNK


class StreamClosedError(Exception):
    """The request was abandoned (its client went away, or the engine closed)."""


@dataclass
class SeqRequest:
    """One generation (or a score) handed to the scheduler thread, and what it produced."""

    prompt: list[int]
    state: bytearray | None  # the cached prefix as sequence state (its first state_size bytes), assembled off
    # the scheduler thread into a pooled buffer
    cached: int
    params: GenParams
    on_text: Callable[[str], None] | None
    stream: TextStream
    sampler: Sampler | None  # None: score(), which samples nothing
    max_new: int
    on_prefill: PrefillHook | None = None
    keeps_state: bool = True  # the finished sequence's state is read back (choice 0: the KV written back)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    seq: int = -1
    fed: int = 0  # tokens of the sequence already in the KV cache
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    finish: str = "length"
    ended_by_token: bool = False
    cut_by_stop: bool = False
    blob: memoryview | None = None  # the finished sequence's state, parsed by the caller: a pooled buffer's start
    blob_buffer: bytearray | None = None  # that buffer, given back once parsed
    error: BaseException | None = None
    scores: list[torch.Tensor] | None = None  # score(): the logits of every fed prompt token, no sampling
    restore_failed: bool = False
    state_size: int = 0
    lent: bool = False  # `state` is a context lent to the pipeline (`context_for`): it comes back from there
    planned: int = 0  # cells `state` holds: those from `cached` on are dropped once it is set
    boundaries: list[tuple[int, bytes]] = field(default_factory=list)  # (position, boundary state): the engine's


class Scheduler:
    """The scheduler thread's side of the llamacpp engine (`_run`), on the engine's llama.cpp context."""

    _lib: Any
    _ctx: Any
    _mem: Any
    _batch: Any
    _vocab_p: Any
    n_vocab: int
    restore_failures: int
    state_geometry: llamastate.StateGeometry
    _inbox: queue.Queue[SeqRequest]
    _free: list[int]
    _active: list[SeqRequest]
    _closed: threading.Event
    _state_buffers: IdlePool[bytearray]
    _snapshots: IdlePool[bytearray]
    boundary_records: bool  # a sliding-window or hybrid model: its boundary state is read at the prompt's end
    prefill_chunk: int  # prompt tokens a step holds (`prefill_chunk`)
    _long_piece_due: float  # perf_counter time from which a long prompt's next piece joins others' decode steps

    def _split(self, blob: bytes | bytearray | memoryview) -> tuple[int, bytes]:
        """Where a state's full-attention KV ends, and the boundary state after it (the engine's)."""
        raise NotImplementedError

    def _run(self) -> None:
        # llama.cpp's OpenMP team runs on this thread: torch here (sampling, a q8_0 state parsed for an early write)
        # keeps to one core, or libgomp parks its workers between regions (service.runtime.threads)
        torch_threads.one_core()
        while not self._closed.is_set():
            self._admit()
            if not self._active:
                continue
            try:
                self._step()
            except Exception as exc:  # never leave a caller waiting: fail what is in flight
                log.exception("llama.cpp step failed")
                for req in list(self._active):
                    self._end(req, RuntimeError(f"generation failed: {exc}"))
        for req in list(self._active):
            self._end(req, StreamClosedError("the engine closed"))
        while not self._inbox.empty():
            self._inbox.get_nowait().done.set()

    def _admit(self) -> None:
        """Move waiting requests into free sequences (blocking briefly when idle)."""
        while self._free:
            try:
                req = self._inbox.get(timeout=0.05) if not self._active else self._inbox.get_nowait()
            except queue.Empty:
                return
            req.seq = self._free.pop(0)
            if req.state is not None:
                buf = (ctypes.c_uint8 * req.state_size).from_buffer(req.state)
                read = self._lib.llama_state_seq_set_data(self._ctx, buf, req.state_size, req.seq)
                del buf  # the bytearray cannot go back to the pool while ctypes holds a view of it
                if not req.lent:  # a lent state goes back from the pipeline (give_context)
                    self._state_buffers.give(req.state)
                if read != req.state_size:  # a refused restore is a miss, never a wrong answer
                    self._lib.llama_memory_seq_rm(self._mem, req.seq, -1, -1)
                    self.restore_failures += 1
                    log.warning("llama.cpp refused a cached prefix of %d tokens; prefilling it", req.cached)
                    req.restore_failed, req.cached = True, 0
                elif req.planned > req.cached:  # a lent state of more cells than the hit: only these were filled
                    self._lib.llama_memory_seq_rm(self._mem, req.seq, req.cached, -1)
                req.state = None
            req.fed = req.cached
            self._active.append(req)

    def _step(self) -> None:
        """One llama_decode: the next token of every generating sequence, then prompt chunks."""
        tokens: list[tuple[int, int, int, bool]] = []  # (token, pos, seq, wants logits)
        owners: list[tuple[SeqRequest, int, int]] = []  # (request, tokens fed, batch index sampled or -1)
        for req in self._active:
            if req.fed >= len(req.prompt):
                tokens.append((req.generated[-1], req.fed, req.seq, True))
                owners.append((req, 1, len(tokens) - 1))
        prefilling = sorted((r for r in self._active if r.fed < len(r.prompt)), key=lambda r: len(r.prompt) - r.fed)
        room = self.prefill_chunk
        # while others decode, a long prompt (one a piece does not finish) gets 1 - DECODE_SHARE of the time
        hold_long = bool(tokens) and time.perf_counter() < self._long_piece_due
        long_piece = False
        for req in prefilling:
            remaining = len(req.prompt) - req.fed
            take = min(self.prefill_chunk, remaining)
            if take > room:  # a piece is whole and never overfills the step: the next one takes it
                break
            last = take == remaining
            if not last:  # a long prompt; the rest, shortest first, are long too
                if hold_long:
                    break
                long_piece = True
            first_index = len(tokens)
            for i in range(take):
                pos = req.fed + i
                tokens.append((req.prompt[pos], pos, req.seq, req.scores is not None or (last and i == take - 1)))
            if req.scores is not None:  # score(): every position's logits, then done
                owners.append((req, take, -2 - first_index))
            else:
                owners.append((req, take, len(tokens) - 1 if last else -1))
            room -= take
        began = time.perf_counter()
        self._decode_tokens(tokens)
        if long_piece:  # the others' decode steps get their share before the next long piece
            ended = time.perf_counter()
            self._long_piece_due = ended + (ended - began) * DECODE_SHARE / (1 - DECODE_SHARE)
        for req, fed, index in owners:
            req.fed += fed
            if index <= -2:
                assert req.scores is not None
                req.scores += [self._logits(i) for i in range(-2 - index, -2 - index + fed)]
                if req.fed == len(req.prompt):
                    self._end(req, None)
            elif index >= 0:
                self._sample(req, self._logits(index))

    def _decode_tokens(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        batch, n = self._batch, len(tokens)
        arr = np.asarray(tokens, dtype=np.int64).reshape(n, 4)
        np.ctypeslib.as_array(batch.token, shape=(N_BATCH,))[:n] = arr[:, 0]
        np.ctypeslib.as_array(batch.pos, shape=(N_BATCH,))[:n] = arr[:, 1]
        np.ctypeslib.as_array(batch.n_seq_id, shape=(N_BATCH,))[:n] = 1
        np.ctypeslib.as_array(batch.logits, shape=(N_BATCH,))[:n] = arr[:, 3]
        for i in range(n):
            batch.seq_id[i][0] = int(arr[i, 2])
        batch.n_tokens = n
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, index: int) -> torch.Tensor:
        """Logits [vocab] of the token at `index` of the last batch."""
        ptr = self._lib.llama_get_logits_ith(self._ctx, index)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def _sample(self, req: SeqRequest, logits: torch.Tensor) -> None:
        assert req.sampler is not None
        token = req.sampler.next(logits)
        if not req.generated:
            req.ttft = time.perf_counter() - req.started
        req.generated.append(token)
        if (req.on_prefill is not None or self.boundary_records and req.keeps_state) and len(req.generated) == 1:
            # the prompt's KV, for early block writes, and its boundary state, for a record at the prompt's end
            buffer, whole = self._snapshot(req.seq)
            kv_end, at_prompt = self._split(whole)
            blob, geo = whole[:kv_end], self.state_geometry
            if self.boundary_records:
                req.boundaries.append((len(req.prompt), at_prompt))
            try:
                if req.on_prefill is not None:
                    req.on_prefill(lambda start, end: llamastate.parse_state(blob, geo, start, end))
            finally:
                blob.release()  # the buffer goes back to the pool: a get_kv kept past the hook raises
                whole.release()
                self._snapshots.give(buffer)
        try:
            if self._lib.llama_vocab_is_eog(self._vocab_p, token):
                req.finish, req.ended_by_token = "stop", True
                req.sampler.drop_last_logprob()
            elif req.stream.push(token):
                req.finish, req.cut_by_stop = "stop", True
            elif req.sampler.done(token):
                req.finish = "stop"
            elif len(req.generated) < req.max_new:
                return
            req.stream.finish()
        except Exception as exc:  # noqa: BLE001 - the client hung up (its callback raised): free the sequence now
            self._end(req, exc)
            return
        if req.keeps_state:
            req.blob_buffer, req.blob = self._snapshot(req.seq)
        self._end(req, None)

    def _snapshot(self, seq: int) -> tuple[bytearray, memoryview]:
        """Sequence `seq`'s state in a pooled buffer (`_snapshots`: at 2048 tokens a fresh 47 MB one costs ~20 ms of
        page faults on this thread, and freeing it unmaps it again): the buffer, to give back once the state is
        parsed, and a view of the state in it."""
        size = self._state_size(seq)
        buffer = self._snapshots.take(size)
        return buffer, memoryview(self._get_state(seq, buffer, size))[:size]

    def _state_size(self, seq: int) -> int:
        return int(self._lib.llama_state_seq_get_size(self._ctx, seq))

    def _get_state(self, seq: int, into: bytearray, size: int) -> bytearray:
        """Sequence `seq`'s state (`size` bytes, `_state_size`) into the start of `into`; returns `into`."""
        written = self._lib.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(into), size, seq)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} state bytes")
        return into

    def _end(self, req: SeqRequest, error: BaseException | None) -> None:
        self._lib.llama_memory_seq_rm(self._mem, req.seq, -1, -1)
        self._active.remove(req)
        self._free.append(req.seq)
        req.error = error
        req.done.set()
