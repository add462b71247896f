"""bench quality's windows: where each window's cache ends within a block, and the frames it round-trips."""

from __future__ import annotations

import torch

from cachestore.codec import read_header
from cachestore.codec.blockcodec import BlockCodecs
from ops.bench.quality.scoring import _cache_ends, _targets, round_trip


def test_spread_ends_cover_every_part_of_a_block_evenly_and_stay_in_the_prefix() -> None:
    ends = _cache_ends(512, 64, 24, "spread")
    assert len(ends) == 24 and max(ends) <= 511 and min(ends) >= 448
    partial = [e % 64 for e in ends]
    assert partial == sorted(partial) and partial[0] == 0 and partial[-1] >= 56
    assert len(set(partial)) == 24  # every window ends at another point
    assert _cache_ends(512, 64, 3, "fixed") == [511] * 3
    assert _cache_ends(40, 64, 2, "spread") == [39, 39]  # shorter than a block: as it was
    assert all(e <= 99 for e in _cache_ends(100, 64, 64, "spread"))


def test_round_trip_gives_the_partial_block_the_recent_codec() -> None:
    kv = torch.randn(2, 2, 1, 64 * 2 + 5, 8, generator=torch.Generator().manual_seed(1))
    frames = round_trip(BlockCodecs.for_spec("int2+zstd/g8/recent=int8"), kv, 64)
    assert [read_header(f).mode for f in frames] == ["int8", "int2", "int8"]
    assert [read_header(f).tokens for f in frames] == [64, 64, 5]
    plain = round_trip(BlockCodecs.for_spec("int2+zstd/g8"), kv, 64)
    assert [read_header(f).mode for f in plain] == ["int8", "int2", "int2"]


def test_a_target_counts_the_upper_end_of_the_interval_and_the_smaller_size() -> None:
    def row(spec: str, lo: float, hi: float, mid: float = 3.6) -> dict:
        return {"text": "t", "mode": spec, "ppl_delta_pct": (lo + hi) / 2, "ppl_delta_lo": lo, "ppl_delta_hi": hi,
                "ratio_vs_fp16_ctx": mid + 0.05, "ratio_vs_fp16_mid": mid, "greedy_match_mean": 20.0}

    targets = _targets([row("int4+zstd", -0.32, 0.10), row("int4", -0.05, 0.27), row("int4/rotv", 0.0, 0.2, 3.48),
                        row("int2+zstd", 1.0, 2.9, 6.1)], greedy_tokens=32)
    met = {name.split(": ")[1]: t["met"] for name, t in targets.items() if name != "greedy"}
    # a lower end below −0.25% is no loss; an upper end over the target is; so is a mid-block size under 3.5x
    assert met == {"int4+zstd": True, "int4": False, "int4/rotv": False, "int2+zstd": True}
