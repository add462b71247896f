"""Attention over landed frames in their codes (cachestore/codec/attend.py and the kernels behind it) is sdpa's
attention over the dequantized context, whatever the codec, the runs, the mask and the kernel's code path."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, FrameRun, attend, kernels

needs_kernel = pytest.mark.skipif(not kernels.enabled(), reason="no native kernel on this CPU or build")
LAYERS, KV_HEADS, GROUP, BLOCK = 2, 2, 3, 16  # three query heads a kv head, blocks of 16 tokens


def _hit(spec: str, dim: int, seed: int) -> tuple[list[attend.Landed], torch.Tensor, list[tuple[int, int]]]:
    """Five blocks: 0-1 and 3-4 landed at one stride (two runs), block 2 decoded into the context (it came as bytes),
    then a tail of 5 tokens in the context. Returns the runs' layer 1, what the five blocks and the tail decode to
    ([LAYERS, 2, KV_HEADS, 85, dim]), and the runs' token spans."""
    gen = torch.Generator().manual_seed(seed)
    codec = Codec(spec)
    kvs = [torch.randn(LAYERS, 2, KV_HEADS, BLOCK, dim, generator=gen) * 2 for _ in range(5)]
    frames = [codec.encode(kv) for kv in kvs]
    stride = -(-len(frames[0]) // 64) * 64 + 64
    buf = torch.zeros(5 * stride, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    slots = [view[i * stride:i * stride + len(f)] for i, f in enumerate(frames)]
    for slot, frame in zip(slots, frames, strict=True):
        slot[:] = frame
    decoded = torch.cat([codec.decode(f, device="cpu").float() for f in frames]
                        + [torch.randn(LAYERS, 2, KV_HEADS, 5, dim, generator=gen)], dim=3)
    runs = []
    for first in (0, 3):
        run = FrameRun.of(buf, [codec.open(s) for s in slots[first:first + 2]])
        assert run is not None and attend.supports(run.header)
        runs.append(attend.landed(run.header, run.count, first * BLOCK, run.layer_parts(1)))
    return runs, decoded, [(0, 2 * BLOCK), (3 * BLOCK, 5 * BLOCK)]


def _context(decoded: torch.Tensor, new: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Layer 1's [2, KV_HEADS, cached + new, dim] as the context holds it: NaN where the runs are (never read)."""
    context = torch.cat([decoded[1], new], dim=2)
    for start, stop in spans:
        context[:, :, start:stop] = float("nan")
    return context


@pytest.mark.usefixtures("level")
@pytest.mark.parametrize("spec", ["int8", "int4", "int4/g32", "fp16", "exact"])
@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("new", [1, 2, 3])  # 3, 6 and 9 queries a kv head: every remainder of the kernels' 4
def test_attention_over_the_codes_is_sdpa_over_the_decoded_context(spec: str, dim: int, new: int) -> None:
    runs, decoded, spans = _hit(spec, dim, dim + new)
    gen = torch.Generator().manual_seed(new)
    query = torch.randn(KV_HEADS * GROUP, new, dim, generator=gen)
    fresh = torch.randn(2, KV_HEADS, new, dim, generator=gen)
    whole = torch.cat([decoded[1], fresh], dim=2)
    total = whole.shape[2]
    causal = torch.ones(new, total, dtype=torch.bool).tril(total - new)
    want = torch.nn.functional.scaled_dot_product_attention(query[None], whole[0][None], whole[1][None],
                                                              attn_mask=causal, scale=dim ** -0.5, enable_gqa=True)[0]
    context = _context(decoded, fresh, spans)
    got = attend.attention(query, runs, context[0], context[1], None, dim ** -0.5)
    assert got is not None and got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_mask_is_applied_as_sdpa_applies_it(kind: str) -> None:
    """transformers' masks: bool (True attends; here a padded context token and a landed one are masked) or added."""
    runs, decoded, spans = _hit("int8", 64, 7)
    gen = torch.Generator().manual_seed(8)
    query, fresh = torch.randn(KV_HEADS * GROUP, 2, 64, generator=gen), torch.randn(2, KV_HEADS, 2, 64, generator=gen)
    whole = torch.cat([decoded[1], fresh], dim=2)
    total = whole.shape[2]
    allowed = torch.ones(2, total, dtype=torch.bool).tril(total - 2)
    allowed[:, [5, 40]] = False
    mask = allowed if kind == "bool" else torch.zeros(2, total).masked_fill(~allowed, float("-inf"))
    want = torch.nn.functional.scaled_dot_product_attention(query[None], whole[0][None], whole[1][None],
                                                              attn_mask=mask, scale=0.125, enable_gqa=True)[0]
    context = _context(decoded, fresh, spans)
    got = attend.attention(query, runs, context[0], context[1], mask[None, None], 0.125)
    assert got is not None and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_without_the_kernels_nothing_is_attended(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSTASH_NATIVE_KERNELS=0: the caller dequantizes instead (LayerGate.fill), and nothing is computed here."""
    runs, decoded, spans = _hit("int8", 64, 3)
    monkeypatch.setattr(kernels, "ENABLED", False)
    frame = Codec("int8").encode(torch.randn(LAYERS, 2, KV_HEADS, BLOCK, 64))
    assert not attend.supports(Codec("int8").open(frame).header)
    context = _context(decoded, torch.zeros(2, KV_HEADS, 1, 64), spans)
    assert attend.attention(torch.zeros(KV_HEADS * GROUP, 1, 64), runs, context[0], context[1], None, 1.0) is None


@needs_kernel
def test_the_kernels_take_only_what_they_can_read() -> None:
    """Frame kinds and shapes outside the kernels' (rotated halves, int2, split layouts, bf16, head dims not a multiple
    of 16, a run past the context) are refused before anything is computed."""
    for spec in ("int4/rotv", "int2", "int4/symv/s8/v5=1", "int4/kbits/s8"):
        kv = torch.randn(LAYERS, 2, KV_HEADS, BLOCK, 64)
        assert not attend.supports(Codec(spec).open(Codec(spec).encode(kv)).header), spec
    bf16 = Codec("exact").open(Codec("exact").encode(torch.randn(LAYERS, 2, KV_HEADS, BLOCK, 64).bfloat16()))
    assert not attend.supports(bf16.header)
    codes = torch.zeros((1, KV_HEADS, BLOCK, 24), dtype=torch.int8)
    scores = torch.full((KV_HEADS, 3, 1, BLOCK), 7.0)
    assert not kernels.attention_scores(scores, torch.zeros(KV_HEADS, 3, 24), codes,
                                        torch.ones((1, KV_HEADS, 1, 24), dtype=torch.float16))  # rows of 24
    codes = torch.zeros((1, KV_HEADS, BLOCK, 16), dtype=torch.int8)
    assert not kernels.attention_scores(scores, torch.zeros(KV_HEADS, 3, 16), codes,
                                        torch.ones((1, KV_HEADS, 1, 16)))  # fp32 scales
    assert not kernels.attention_scores(scores, torch.zeros(KV_HEADS, 3, 16), codes)  # int8 without its scales
    assert not kernels.attention_values(torch.zeros(KV_HEADS, 3, 16), scores, codes.float().half(),
                                        torch.ones((1, KV_HEADS, BLOCK, 1), dtype=torch.float16))  # fp16 has none
    assert (scores == 7).all()
    runs, decoded, spans = _hit("int8", 64, 4)
    short = _context(decoded, torch.zeros(2, KV_HEADS, 1, 64), spans)[:, :, :60]  # the second run ends at 80
    with pytest.raises(ValueError, match="landed run"):
        attend.attention(torch.zeros(KV_HEADS * GROUP, 1, 64), runs, short[0], short[1], None, 1.0)
