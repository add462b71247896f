"""A pod-local, in-memory prefix cache: the sticky-sessions baseline (`kvstash serve --no-cache --memory-kv-bytes N`).

What vLLM's or SGLang's prefix cache and llama-server's slots do inside the engine: the pod keeps the KV of
the sequences it processed (prompt + reply, as the engine returned them) in its own memory, with no Redis
and no codec, and a later prompt that continues one of them reuses its longest common token prefix. Only
the pod that computed a sequence can reuse it, so it pays only behind a balancer that sends a session to
the same pod every time (nginx `hash $http_x_session_id consistent`), and a restarted pod has lost it all.

Byte-bounded LRU. A sequence that continues a kept one replaces it (the new one holds all of it); a
sequence that a kept one already continues is not kept twice. Entries are scoped by the tenant's salt.
Not thread-safe: the pipeline calls it from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cachestore.codec.arrays import ITEMSIZE, Array, dtype_name, numel

MAX_REPLIES = 1024  # remembered reply texts (text -> the ids generated for it), least recently used dropped


@dataclass(frozen=True)
class MemoryMatch:
    """The longest kept prefix of a prompt: kv[..., :tokens] may be reused."""

    kv: Array  # [layers, 2, kv_heads, kept_tokens, head_dim], never written to
    tokens: int
    status: str  # "hit": the whole kept sequence (or every usable token) matched; "partial": less


@dataclass
class _Entry:
    salt: bytes
    ids: np.ndarray  # int64 [tokens]
    kv: Array  # [layers, 2, kv_heads, tokens, head_dim]
    nbytes: int


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    same = a[:n] == b[:n]
    return n if bool(same.all()) else int(np.argmin(same))


class MemoryKV:
    """Sequences' KV tensors by token ids, at most `max_bytes` of tensor data, least recently used evicted."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self.bytes_held = 0
        self.evictions = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._replies: OrderedDict[tuple[bytes, str], list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, salt: bytes, ids: Sequence[int]) -> MemoryMatch | None:
        """The kept sequence sharing the longest prefix with `ids` (pass the prompt less its last token, which
        is always re-fed), or None when none shares a token."""
        wanted = np.asarray(ids, dtype=np.int64)
        best, best_len = None, 0
        for key, entry in self._entries.items():
            if entry.salt == salt and (m := _common(wanted, entry.ids)) > best_len:
                best, best_len = key, m
        if best is None:
            return None
        self._entries.move_to_end(best)
        entry = self._entries[best]
        whole = best_len == len(entry.ids) or best_len == len(wanted)
        return MemoryMatch(entry.kv, best_len, "hit" if whole else "partial")

    def put(self, salt: bytes, seq_ids: Sequence[int], kv: Array) -> bool:
        """Keep `kv` [layers, 2, kv_heads, len(seq_ids), head_dim] (not copied: the caller hands it over and
        never writes to it again). False when it is larger than the whole budget or already held."""
        if kv.ndim != 5 or kv.shape[3] != len(seq_ids):
            raise ValueError(f"kv {tuple(kv.shape)} does not cover {len(seq_ids)} tokens")
        nbytes = numel(kv) * ITEMSIZE[dtype_name(kv)]
        if not seq_ids or nbytes > self.max_bytes:
            return False
        ids = np.asarray(seq_ids, dtype=np.int64)
        for key, entry in list(self._entries.items()):
            if entry.salt != salt:
                continue
            m = _common(ids, entry.ids)
            if m == len(ids):  # a kept sequence already continues this one
                self._entries.move_to_end(key)
                return False
            if m == len(entry.ids):  # this one continues a kept sequence: the kept one holds nothing more
                self._drop(key)
        self._entries[self._next] = _Entry(salt, ids, kv, nbytes)
        self._next += 1
        self.bytes_held += nbytes
        while self.bytes_held > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        return True

    def _drop(self, key: int) -> None:
        self.bytes_held -= self._entries.pop(key).nbytes

    def remember_reply(self, salt: bytes, text: str, ids: list[int] | None, decode: Callable[[list[int]], str]) -> None:
        """The ids generated for a reply's exact text, so a client sending that text back gets the same tokens
        (what kvstash keeps in Redis as reply ids; here only this pod knows them)."""
        if not ids or not text or decode(ids) != text:
            return
        self._replies[(salt, text)] = list(ids)
        self._replies.move_to_end((salt, text))
        while len(self._replies) > MAX_REPLIES:
            self._replies.popitem(last=False)

    def known_replies(self, salt: bytes, messages: list[dict[str, str]]) -> dict[int, list[int]]:
        """Assistant messages whose exact text this pod generated: message index -> the generated ids."""
        known: dict[int, list[int]] = {}
        for i, m in enumerate(messages):
            ids = self._replies.get((salt, m.get("content", ""))) if m.get("role") == "assistant" else None
            if ids is not None:
                known[i] = list(ids)
        return known
