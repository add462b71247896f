"""What extends a hit past its full blocks: the tail some pod left after them, or the session's partial block."""

from __future__ import annotations

from cachestore.codec.arrays import Array
from cachestore.sessions import SessionRecord
from service.cache.cacheview import CacheView
from service.cache.framegate import FrameGate
from service.runtime.metrics import PodMetrics


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Partials:
    """Merges a tail or a session's partial block into a hit's context and says what the hit amounts to."""

    def __init__(self, gate: FrameGate, metrics: PodMetrics, block_tokens: int, model_key: str) -> None:
        self.gate = gate
        self.metrics = metrics
        self.block_tokens = block_tokens
        self.model_key = model_key

    def continues(self, session: SessionRecord | None, hit_blocks: int) -> bool:
        """Whether the session's partial block continues this hit (then it extends the hit)."""
        return (session is not None and session.model == self.model_key and bool(session.partial)
                and hit_blocks == len(session.token_ids) // self.block_tokens)

    def view(
        self, out: Array, hit_blocks: int, fetched: int, session: SessionRecord | None,
        prompt_ids: list[int], usable: int, tail: bytes | None = None,
    ) -> CacheView:
        """The view of a hit of `hit_blocks` blocks in `out`, extended by `tail` or the session's partial block."""
        b = self.block_tokens
        cached = hit_blocks * b
        if tail is not None:
            added = self._apply_tail(tail, out, cached, prompt_ids, usable)
            cached, fetched = cached + added, fetched + (len(tail) if added else 0)
        # "hit": everything reusable was reused: the whole known history of a session, else every
        # full block of the prompt. "partial": some of it. "miss": none.
        target = (usable // b) * b
        if session is not None and session.model == self.model_key:
            session_full = len(session.token_ids) // b
            common = min(common_prefix(session.token_ids, prompt_ids), usable)
            target = common
            if session.partial and hit_blocks == session_full and common > cached:
                partial = self.gate.decode(session.partial, len(session.token_ids) - session_full * b, session_full)
                if partial is not None:
                    take = common - cached
                    out[:, :, :, cached:common] = partial[:, :, :, :take]
                    cached = common
                    fetched += len(session.partial)
        kv = out[:, :, :, :cached] if cached else None  # [L, 2, H, cached, D]
        status = "miss" if cached == 0 else ("hit" if cached >= target else "partial")
        return CacheView(kv, cached, hit_blocks, status, fetched)

    def _apply_tail(self, value: bytes, out: Array, start: int, prompt_ids: list[int], usable: int) -> int:
        """Decode a tail of n tokens and place the KV of its first m in out[..., start:start + m], m being as many
        as the prompt continues (a token's KV depends only on the tokens up to it: the same prompt sent again
        reuses the tail its last request left, reply tokens and all, up to the prompt's end; an edited last
        message, up to the edit); returns m, or 0 when the tail is foreign, forged, corrupt or shares nothing."""
        opened = self.gate.tail(value)
        if opened is None:
            return 0
        tokens, frame = opened
        n = len(tokens)
        take = common_prefix(tokens, prompt_ids[start:usable]) if n < self.block_tokens else 0
        if take == 0:
            self.metrics.tail_lookups.labels("mismatch").inc()
            return 0
        kv = self.gate.decode(frame, n, start // self.block_tokens)  # [L, 2, H, n, D]
        if kv is None:
            return 0
        out[:, :, :, start:start + take] = kv[:, :, :, :take]
        self.metrics.tail_lookups.labels("used").inc()
        return take
