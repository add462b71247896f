"""The pod's pool of context buffers: reuse, capacity rounding, and a bound on what it keeps."""

from __future__ import annotations

import torch

from service.runtime.contextpool import ROUND_TOKENS, ContextPool


def test_buffers_are_reused_and_bounded() -> None:
    pool = ContextPool(layers=2, kv_heads=3, head_dim=4, dtype=torch.float32, max_idle=2)
    a = pool.take(10)
    assert a.shape == (2, 2, 3, ROUND_TOKENS, 4) and a.dtype == torch.float32
    pool.give(a)
    assert pool.take(ROUND_TOKENS) is a  # fits: the same memory, already paged in
    big = pool.take(ROUND_TOKENS + 1)
    assert big.shape[3] == 2 * ROUND_TOKENS
    pool.give(a)
    pool.give(big)
    pool.give(pool.take(3 * ROUND_TOKENS))
    assert pool.idle == 2  # only the two largest are kept
    assert pool.take(5).shape[3] == 2 * ROUND_TOKENS  # the smallest one that fits
