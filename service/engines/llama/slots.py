"""The llama-server engine's slots: which slot serves a request, and cached KV into it and out of it as slot files.

A slot is leased for a request and holds what this engine believes it kept of the last one (checked against
llama-server's timings); cached KV enters it as a slot file written into llama-server's `--slot-save-path` and
restored, and leaves it saved and parsed (service.engines.llama.slotfile). A failure is a miss, counted in `stats`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from cachestore.codec.arrays import Array
from service.engines.gate import LayerGate
from service.engines.llama import boundarystate, llamastate, slotfile
from service.engines.llama.lending import StateLender
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.engines.server import SlotLease

log = logging.getLogger("kvstash.llamaserver")


class UpstreamError(RuntimeError):
    """llama-server answered a generation with an error."""


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)  # what we believe the slot holds (a hint, checked by timings)
    busy: bool = False
    last_used: float = 0.0


@dataclass
class SidecarStats:
    """What happened to cached KV on its way into llama-server (exported as metrics by the sidecar)."""

    restores: int = 0  # slot files restored
    restored_tokens: int = 0
    restore_failures: int = 0  # restore refused or file unwritable: prefilled instead
    reuse_misses: int = 0  # llama-server prefilled tokens it should have reused (timings.cache_n too small)
    save_failures: int = 0  # slot not saved or its file unreadable: nothing written back
    restore_s: float = 0.0
    save_s: float = 0.0
    bypassed: dict[str, int] = field(default_factory=dict)  # requests sent past the cache, by reason


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


class SlotKeeper:
    """The llama-server engine's side of its slots (`lease`, `finish`, `abandon`), on its HTTP calls."""

    slot_dir: Path
    reuse_slots: bool
    state_geometry: llamastate.StateGeometry
    stats: SidecarStats
    _prefix: str
    _slots: list[Slot]
    _cond: threading.Condition
    _lender: StateLender
    _restarts_seen: int
    process: LlamaServerProcess | None
    boundary_records: bool
    _section_kinds: tuple[str, ...]

    def _slot_action(self, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
        raise NotImplementedError  # llama-server's POST /slots/{id}?action=: the engine's HTTP call

    def _acquire(self, prompt: list[int], count: int = 1) -> list[Slot]:
        """`count` free slots, all at once: first the one sharing the longest prefix with `prompt` (least recently
        used on a tie), then the least recently used others (llama-server decodes a request's other choices of `n`
        there)."""
        count = max(1, min(count, len(self._slots)))
        with self._cond:
            if self.process is not None and self.process.restarts != self._restarts_seen:
                self._restarts_seen = self.process.restarts  # a restarted llama-server holds nothing
                for s in self._slots:
                    s.tokens = []
            while True:
                free = [s for s in self._slots if not s.busy]
                if len(free) >= count:
                    best = max(free, key=lambda s: (common_prefix(s.tokens, prompt), -s.last_used))
                    others = sorted((s for s in free if s is not best), key=lambda s: s.last_used)[: count - 1]
                    for s in (best, *others):
                        s.busy = True
                    return [best, *others]
                self._cond.wait()

    def _distrust_slots(self) -> None:
        """Forget what the other idle slots were believed to hold (their next request restores from the cache)."""
        with self._cond:
            for s in self._slots:
                if not s.busy:
                    s.tokens = []

    def _release(self, slot: Slot, tokens: list[int]) -> None:
        with self._cond:
            slot.tokens, slot.busy, slot.last_used = tokens, False, time.monotonic()
            self._cond.notify_all()

    def _erase(self, slot: int) -> None:
        try:
            self._slot_action(slot, "erase")
        except (UpstreamError, httpx.HTTPError):
            log.warning("could not erase llama-server slot %d", slot)

    def _restore(self, slot: Slot, tokens: list[int], kv: Array, boundary: bytes | None = None) -> bool:
        """Put `kv` [layers, 2, kv_heads, len(tokens), head_dim] into the slot; False (a miss) on any failure."""
        name = f"{self._prefix}-slot{slot.id}.bin"
        path = self.slot_dir / name
        t0 = time.perf_counter()
        try:
            lent = self._lender.take(kv, len(tokens))  # a context lent: its state's own rows are the file's
            geo = self.state_geometry
            pieces = (slotfile.from_state(tokens, lent.state, lent.cells, geo) if lent is not None
                      else slotfile.assemble(tokens, kv, geo))
            if self.boundary_records:  # the window / recurrent state after the full-attention KV
                if boundary is None:
                    raise llamastate.StateLayoutError("a sliding-window or hybrid slot needs its boundary state")
                pieces += boundarystate.with_streams(boundary, self._section_kinds[1:], geo.n_stream)
            slotfile.write_pieces(path, pieces)
            answer = self._slot_action(slot.id, "restore", name)
            if int(answer.get("n_restored", -1)) != len(tokens):
                raise UpstreamError(f"restored {answer.get('n_restored')} of {len(tokens)} tokens")
        except (OSError, UpstreamError, httpx.HTTPError, llamastate.StateLayoutError) as exc:
            log.warning("slot %d: restoring %d cached tokens failed (%s); prefilling them", slot.id, len(tokens), exc)
            self.stats.restore_failures += 1
            self._erase(slot.id)  # never leave a half-restored slot behind
            return False
        finally:
            path.unlink(missing_ok=True)
        self.stats.restores += 1
        self.stats.restored_tokens += len(tokens)
        self.stats.restore_s += time.perf_counter() - t0
        return True

    def _save(self, slot: Slot, prompt: list[int], keep_from: int = 0) -> slotfile.SlotFile | None:
        """The slot's tokens and their KV from token `keep_from` on, after a reply; None (nothing written back) on any
        failure."""
        name = f"{self._prefix}-slot{slot.id}.bin"
        path = self.slot_dir / name
        t0 = time.perf_counter()
        try:
            self._slot_action(slot.id, "save", name)
            saved = self._read_slot(path.read_bytes(), keep_from)
            if saved.tokens[: len(prompt)] != prompt:
                raise llamastate.StateLayoutError("the saved slot does not begin with the prompt")
        except (OSError, UpstreamError, httpx.HTTPError, llamastate.StateLayoutError) as exc:
            log.warning("slot %d: saving failed (%s); nothing written back", slot.id, exc)
            self.stats.save_failures += 1
            return None
        finally:
            path.unlink(missing_ok=True)
        self.stats.save_s += time.perf_counter() - t0
        return saved

    def _read_slot(self, data: bytes, keep_from: int) -> slotfile.SlotFile:
        """A saved slot's tokens, KV from `keep_from` on, and (a sliding-window or hybrid model) boundary state."""
        if not self.boundary_records:
            return slotfile.parse(data, self.state_geometry, keep_from)
        state = slotfile.state_of(data)
        kv_end, boundary = boundarystate.split_state(state, self._section_kinds)
        saved = slotfile.parse(memoryview(data)[:len(data) - len(state) + kv_end], self.state_geometry, keep_from)
        return replace(saved, boundary=boundary)

    def restore_file(self, slot: int, filename: str) -> int:
        """Restore a slot file already in the slot directory (llama-server's own mechanism, for comparisons);
        returns the tokens restored."""
        with self._cond:
            self._slots[slot].tokens = []
        return int(self._slot_action(slot, "restore", filename).get("n_restored", 0))

    def forget(self) -> None:
        """Empty every idle slot (llama-server's and what this engine believes it holds): the next requests
        reuse only what they restore from the cache."""
        with self._cond:
            for s in self._slots:
                if not s.busy:
                    self._erase(s.id)
                    s.tokens = []

    # -- a request's slot: lease, then finish -----------------------------------------------------------
    def lease(self, prompt_ids: Sequence[int], cached_kv: Array | None, kv_ready: LayerGate | None = None,
              slots: int = 1, boundary: bytes | None = None) -> SlotLease:
        """A slot for a request of `prompt_ids` (and `slots - 1` more held for its other choices), holding the
        prompt's first tokens: what the slot kept of an earlier request, or `cached_kv` [layers, 2, kv_heads, cached,
        head_dim] restored into it when that is longer. Blocks until enough slots are free; pass the lease to
        `finish` (or `abandon`) exactly once."""
        prompt = [int(i) for i in prompt_ids]
        cached = min(int(cached_kv.shape[3]), len(prompt) - 1) if cached_kv is not None else 0
        taken = self._acquire(prompt, slots)
        slot = taken[0]
        try:
            have = common_prefix(slot.tokens, prompt) if self.reuse_slots else 0
            if cached > have and cached_kv is not None:
                if kv_ready is not None:
                    kv_ready.wait_all()  # a slot file is written whole: every layer first
                if self.boundary_records and cached != cached_kv.shape[3]:
                    raise ValueError("a sliding-window or hybrid model resumes at a boundary: the KV of every token "
                                     "before it")
                have = cached if self._restore(slot, prompt[:cached], cached_kv[:, :, :, :cached], boundary) else 0
        except BaseException:
            for s in taken:
                self._release(s, [])
            raise
        return SlotLease(slot.id, taken, prompt, min(have, len(prompt) - 1))

    def finish(self, lease: SlotLease, reused: int, keep_from: int = 0, save: bool = True) -> slotfile.SlotFile | None:
        """After the request: check with llama-server's `timings.cache_n` (`reused`) that it reused what the slot
        held (a shortfall is counted and cost a prefill), save the slot and read its tokens and their KV from token
        `keep_from` on (None when it could not be saved or does not begin with the prompt, or `save` is false), and give
        the slots back."""
        if reused < lease.expected:
            self.stats.reuse_misses += 1
            log.warning("slot %d: llama-server reused %d of %d expected tokens", lease.slot, reused, lease.expected)
            self._distrust_slots()  # a restarted llama-server emptied every slot, not only this one
        saved: slotfile.SlotFile | None = None
        try:
            saved = self._save(lease.slots[0], lease.prompt, keep_from) if save else None
        finally:
            self._release(lease.slots[0], saved.tokens if saved is not None else [])
            for s in lease.slots[1:]:
                self._release(s, [])  # llama-server empties the slots of a request's other choices
        return saved

    def abandon(self, lease: SlotLease) -> None:
        """Give a lease's slots back when its request failed or was cancelled: what they hold is unknown."""
        for s in lease.slots:
            self._release(s, [])
