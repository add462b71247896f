"""Frame format 6: key channels in classes of 0, 2, 3 or 4 bits under int2, 3 to 6 under int4 (`/kbits`) and keys
stored without their block's RoPE (`/unrope`), each frame carrying what its decoding needs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from cachestore.codec import Codec
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.dequant import key_class_map, unpack
from cachestore.codec.frame import HEADER_SIZE, KEY_CLASS_BITS, KEY_CLASSES, OUTLIER_KEYS, key_classes, parse_header
from cachestore.codec.rope import ADJACENT, HALVES, Rope, turn, turn_into
from cachestore.codec.spec import CodecSpec, recent_spec
from cachestore.errors import CodecError, ConfigError
from tests.support import check_layers_decode_apart, kv_sample, resealed

KBITS = "int2+none/g64/rotv/clip/kbits/symv/s8"
BOTH = KBITS + "/unrope"
KBITS4 = "int4+none/g64/kbits/s8"


def _rope(dim: int, pairing: str = HALVES, base: float = 10000.0) -> Rope:
    return Rope(pairing, tuple(base ** (-2 * i / dim) for i in range(dim // 2)))


def _roped(kv: torch.Tensor, rope: Rope, start: int = 0) -> torch.Tensor:
    """kv [L, 2, H, T, D] with RoPE applied to its keys as a model does, the first token at position `start`."""
    out = kv.clone()
    keys = torch.cat([torch.zeros_like(kv[:, 0, :, :1]).expand(-1, -1, start, -1), kv[:, 0]], 2)
    out[:, 0] = turn(keys, rope, 1)[:, :, start:]
    return out


@pytest.mark.parametrize("pairing", [HALVES, ADJACENT])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_turning_in_place_writes_the_same_bits_as_turn(pairing: str, dtype: torch.dtype) -> None:
    rope = _rope(64, pairing)
    context = (torch.randn(2, 3, 200, 64, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    block = context[:, :, 64:128]  # a strided view, as a block of a context is
    expected = turn(block, rope, 1).to(dtype)
    before = context.clone()
    turn_into(block, rope, 1)
    assert torch.equal(block.view(torch.int16 if dtype == torch.float16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.float16 else torch.int32))
    assert torch.equal(context[:, :, :64], before[:, :, :64]) and torch.equal(context[:, :, 128:], before[:, :, 128:])


def test_one_bit_fields_unpack_in_bit_order() -> None:
    packed = torch.randint(0, 256, (1001,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    bits = ((packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    assert torch.equal(unpack(packed, 1, 8005), bits[:8005])


@pytest.mark.parametrize("pairing", [HALVES, ADJACENT])
def test_turning_back_and_forth_restores_the_keys(pairing: str) -> None:
    rope = _rope(64, pairing)
    keys = torch.randn(2, 3, 40, 64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(turn(turn(keys, rope, -1), rope, 1), keys, atol=1e-5)
    assert Rope.from_section(rope.section()) == rope
    turned = turn(keys, rope, 1)  # a plain rotation: every token keeps its norm, token 0 does not move
    assert torch.allclose(turned.norm(dim=-1), keys.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(turned[:, :, 0], keys[:, :, 0])


def test_a_rope_record_a_frame_must_not_hold_is_refused() -> None:
    section = _rope(16).section()
    for bad in (2.0, 0.5, -1.0):
        section[-1] = bad
        with pytest.raises(CodecError, match="pairing"):
            Rope.from_section(section)
    section[-1] = 0.0
    section[0] = float("nan")
    with pytest.raises(CodecError, match="frequencies"):
        Rope.from_section(section)


@pytest.mark.parametrize(("spec", "bound"), [
    (KBITS, 0.1), (BOTH, 0.1), ("int2+zstd/rotv/clip/outk/symv/s8/unrope", 0.1), (KBITS + "/v3=1", 0.1),
    (KBITS4, 0.02), (KBITS4 + "/unrope/v5=1", 0.02), ("int4+zstd/rotv/clip/kbits/s8/unrope", 0.02)])
def test_format6_frames_round_trip_and_decode_a_layer_range_alike(spec: str, bound: float) -> None:
    """Random KV (a fifth of its key channels decode to their group's mean under int2's /kbits), the model's RoPE on
    its keys from position 320 on; `bound` the keys' relative squared error (values': int2 0.15, int4 0.02)."""
    rope = _rope(64)
    kv = _roped(kv_sample((3, 2, 2, 64, 64), torch.float32, seed=4), rope, start=320)
    frame = Codec(spec, rope).encode(kv)
    assert frame[4] == (7 if "int4" in spec and "/kbits" in spec else 6)  # the format version: int4's classes 7
    out = Codec().decode(frame, device="cpu")
    keys, values = kv[:, 0], kv[:, 1]
    key_err = (out[:, 0] - keys).square().sum() / keys.square().sum()
    value_err = (out[:, 1] - values).square().sum() / values.square().sum()
    assert float(key_err) < bound and float(value_err) < (0.15 if spec.startswith("int2") else 0.02), (
        float(key_err), float(value_err))
    check_layers_decode_apart(spec, ((4, 2, 2, 64, 64), (4, 2, 1, 40, 64)), rope=rope)


def test_unroped_keys_lose_less_than_roped_ones() -> None:
    """Per-channel quantization of keys whose channels are steady once RoPE is undone (as a model's are: a key's
    channel carries the same feature at every position), with and without /unrope, at the same bits."""
    rope = _rope(64)
    gen = torch.Generator().manual_seed(3)
    steady = torch.randn(2, 1, 2, 1, 64, generator=gen) * 3 + torch.randn(2, 1, 2, 64, 64, generator=gen) * 0.3
    kv = _roped(torch.cat([steady, torch.randn(2, 1, 2, 64, 64, generator=gen)], 1), rope, start=1000)
    errors = {}
    for spec in ("int2+none/rotv/clip/outk/symv/s8", "int2+none/rotv/clip/outk/symv/s8/unrope"):
        out = Codec().decode(Codec(spec, rope).encode(kv), device="cpu")
        errors[spec] = float((out[:, 0] - kv[:, 0]).square().mean())
    assert errors["int2+none/rotv/clip/outk/symv/s8/unrope"] < 0.5 * errors["int2+none/rotv/clip/outk/symv/s8"], errors


def test_each_key_group_holds_every_class_in_its_count_the_most_important_at_4_bits() -> None:
    kv = kv_sample((2, 2, 2, 64, 128), torch.float32, seed=5)
    kv[:, 0, :, :, 7] *= 40  # one channel of every head far wider and stronger than the rest
    frame = Codec(KBITS).encode(kv)
    opened = Codec().open(frame, device="cpu")
    cls = key_class_map(_section(opened, "kcls"), "int2", 128)  # [L, H, groups, D]
    for c, count in enumerate(key_classes("int2", 128)):
        assert bool(((cls == c).sum(-1) == count).all())
    assert bool((cls[..., 7] == KEY_CLASS_BITS["int2"].index(4)).all())
    out = opened.decode_into()
    # 0-bit channels decode to one value a group (one group here): their mean, within a step of the range codes
    where = (cls[:, :, 0] == 0).unsqueeze(2).expand_as(out[:, 0])
    mean = kv[:, 0].mean(2, keepdim=True).expand_as(kv[:, 0])
    step = (kv[:, 0].amax((2, 3), keepdim=True) - kv[:, 0].amin((2, 3), keepdim=True)).expand_as(mean) / 255
    assert bool(where.any())
    assert bool(((out[:, 0] - mean).abs()[where] <= step[where] * 1.01 + mean.abs()[where] * 2.0**-10).all())


def test_int4_classes_put_the_bits_where_the_error_is() -> None:
    """int4 /kbits: 3, 4, 5 or 6 bits a key channel in their counts, the most important channel at 6 bits (decoded
    within half its step), and on keys whose channels differ in scale (as a model's do) less squared error than every
    channel at 4 bits, for a quarter of a bit more a channel (format 7's counts)."""
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn(2, 2, 2, 64, 128, generator=gen)
    kv[:, 0] *= torch.randn(2, 2, 1, 128, generator=gen).exp()  # channel scales across an order of magnitude
    kv[:, 0, :, :, 9] *= 40
    opened = Codec().open(Codec(KBITS4).encode(kv), device="cpu")
    cls = key_class_map(_section(opened, "kcls"), "int4", 128)
    for c, count in enumerate(key_classes("int4", 128)):
        assert count and bool(((cls == c).sum(-1) == count).all())
    assert KEY_CLASS_BITS["int4"] == (3, 4, 5, 6) and bool((cls[..., 9] == 3).all())
    out = opened.decode_into().float()
    wide = kv[:, 0, :, :, 9]
    step = (wide.amax(-1, keepdim=True) - wide.amin(-1, keepdim=True)) / 63
    assert bool(((out[:, 0, :, :, 9] - wide).abs() <= step * 0.51 + wide.abs() * 2.0**-10).all())
    plain = Codec().decode(Codec("int4+none/g64/symv/s8").encode(kv), device="cpu").float()
    err = float((out[:, 0] - kv[:, 0]).square().sum())
    assert err < 0.6 * float((plain[:, 0] - kv[:, 0]).square().sum())


def _section(opened: Any, name: str) -> torch.Tensor:
    """Section `name` of an opened frame's payload as stored (before its ranges or class map are expanded)."""
    from cachestore.codec.plan import plan  # noqa: PLC0415

    sections, offsets, _ = plan(opened.header)
    i = _names(opened).index(name)
    dtype_name, shape = sections[i]
    dtype = getattr(torch, dtype_name)
    raw = torch.from_numpy(opened.raw.copy())  # the payload, on the host (a numpy array)
    return raw[offsets[i]:offsets[i] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def _names(opened: Any) -> list[str]:
    from cachestore.codec.layout import Dims, split_layout  # noqa: PLC0415
    from cachestore.codec.plan import variant_of  # noqa: PLC0415

    h = opened.header
    return list(split_layout(h.mode, Dims(h.layers, h.kv_heads, h.tokens, h.head_dim), h.group_size, variant_of(h),
                             h.hi_counts))


def test_a_class_map_without_each_class_count_is_refused() -> None:
    frame = bytearray(Codec(KBITS).encode(kv_sample((1, 2, 1, 64, 64), torch.float32, seed=6)))
    opened = Codec().open(bytes(frame))
    at = HEADER_SIZE + _offset(opened, "kcls")
    frame[at] ^= 0x03  # channel 0 now of another class: one class one channel short in that group
    with pytest.raises(CodecError, match="key channel classes"):
        Codec().decode(resealed(frame), device="cpu")


def _offset(opened: Any, name: str) -> int:
    from cachestore.codec.plan import plan  # noqa: PLC0415

    return plan(opened.header)[1][_names(opened).index(name)]


def test_a_rope_section_a_frame_must_not_hold_is_refused() -> None:
    frame = bytearray(Codec(BOTH, _rope(64)).encode(kv_sample((1, 2, 1, 64, 64), torch.float32, seed=7)))
    at = HEADER_SIZE + _offset(Codec().open(bytes(frame)), "rope") + 32 * 4  # the pairing code, after 32 frequencies
    frame[at:at + 4] = torch.tensor([3.0]).numpy().tobytes()
    with pytest.raises(CodecError, match="pairing"):
        Codec().decode(resealed(frame), device="cpu")


def test_headers_of_format6_that_do_not_fit_are_refused() -> None:
    frame = bytearray(Codec(KBITS).encode(kv_sample((1, 2, 1, 64, 64), torch.float32, seed=8)))
    for transform, version in ((frame[9] | OUTLIER_KEYS, 6), (frame[9], 5), (frame[9] & ~KEY_CLASSES, 6)):
        bad = bytearray(frame)
        bad[9], bad[4] = transform, version
        with pytest.raises(CodecError):
            parse_header(resealed(bad), max_elements=1 << 30)
    with pytest.raises(CodecError, match="classes"):  # classes need a head_dim that is a multiple of 64
        bad = bytearray(frame)
        bad[24:28] = (32).to_bytes(4, "little")
        parse_header(resealed(bad), max_elements=1 << 30)


@pytest.mark.parametrize(("spec", "why"), [
    ("int4+zstd/kbits/s8/k5=1", "kbits"), ("int4+zstd/kbits", "kbits"), ("int2+zstd/kbits/symv", "kbits"),
    ("int2+zstd/outk/kbits/s8", "kbits"),
    ("int2+zstd/kbits/symv/s8/k3=1", "kbits"), ("int2+zstd/rotv/clip/unrope", "unrope"),
    ("int2+zstd/symv/unrope", "unrope")])
def test_specs_format6_cannot_hold_are_refused(spec: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        CodecSpec.parse(spec)


def test_spec_names_round_trip_and_the_partial_block_under_kbits_takes_outlier_channels() -> None:
    spec = CodecSpec.parse("int2+zstd:16/rotv/clip/kbits/symv/s8/unrope/v3=0.2/recent=int4")
    assert CodecSpec.parse(spec.name()) == spec
    assert spec.name() == "int2+zstd:16/g64/rotv/clip/kbits/symv/s8/unrope/v3=0.2/recent=int4"
    recent = recent_spec(spec)
    assert recent.mode == "int4" and recent.variant is not None
    assert recent.variant.outlier_keys and not recent.variant.key_classes and recent.variant.unrope
    with pytest.raises(ConfigError, match="multiple of 64"):
        spec.check_model(30, 48)


def test_unrope_needs_the_engines_rope() -> None:
    with pytest.raises(ConfigError, match="RoPE"):
        BlockCodecs.for_spec(BOTH)
    codecs = BlockCodecs.for_spec(BOTH + "/recent=int4", rope=_rope(64))
    kv = kv_sample((2, 2, 1, 40, 64), torch.float32, seed=9)
    assert codecs.recent.rope is not None and Codec().decode(codecs.recent.encode(kv), device="cpu").shape == kv.shape


def test_the_hf_engine_declares_the_rope_its_keys_carry(tiny_model: Any) -> None:
    """Golden: layer 0's keys before RoPE depend on the token alone, so the same token at two positions gives the same
    key once the declared RoPE is undone from position 0 on; with the other pairing, or none, it does not."""
    from service.engines.hf import hfcache  # noqa: PLC0415
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415

    rope = HfEngine(tiny_model).kv_layout.rope
    assert rope is not None and rope.pairing == HALVES and rope.head_dim == tiny_model.head_dim
    ids = [17, 400, 23, 999, 5, 17, 61, 17]
    with torch.inference_mode():
        _, cache = hfcache.forward(tiny_model.model, ids, None)
    keys = hfcache.tensor_from_cache(cache)[0, 0].float()  # layer 0 [H, T, D]
    plain = turn(keys, rope, -1)
    assert torch.allclose(plain[:, 0], plain[:, 5], atol=1e-4) and torch.allclose(plain[:, 0], plain[:, 7], atol=1e-4)
    assert not torch.allclose(keys[:, 0], keys[:, 5], atol=1e-2)
    other = turn(keys, Rope(ADJACENT, rope.inv_freq), -1)
    assert not torch.allclose(other[:, 0], other[:, 5], atol=1e-2)


def test_pods_store_int4_key_classes_without_rope_and_another_pod_hits_them(redis_server: Any) -> None:
    """The recommended int4's options end to end on a model of head_dim 128 whose RoPE the hf engine declares: the
    blocks in Redis are format 6 int4 frames with key classes and unroped keys, and the other pod hits them."""
    from cachestore.codec import read_header  # noqa: PLC0415
    from cachestore.codec.frame import LAYER_TABLE, SCALE8, UNROPE  # noqa: PLC0415
    from service.engines.hf.engine import HfEngine  # noqa: PLC0415
    from tests.support import SHORT_HISTORY, computed_tokens, follow_up, pod_pair  # noqa: PLC0415
    from tests.tinymodels import tiny_hf_dir  # noqa: PLC0415

    model = str(tiny_hf_dir("llama3-hd128"))
    engine = HfEngine.load(model)
    with pod_pair(redis_server, engine, engine="hf", model=model,
                  codec="int4+zstd/kbits/s8/unrope/v5=1/recent=int8") as (a, b):
        first, second = follow_up(a, b, SHORT_HISTORY, model=engine.name, max_tokens=8)
        raw = redis_server.client()
        headers = {(h.mode, h.version, h.transform) for h in map(read_header, map(raw.get, raw.scan_iter("*:blk:*")))}
        assert ("int4", 7, KEY_CLASSES | UNROPE | SCALE8 | LAYER_TABLE) in headers
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == computed_tokens(first)
        assert not [line for line in b.get("/metrics").text.splitlines()
                    if line.startswith("kvstash_cache_rejected_total{")]
