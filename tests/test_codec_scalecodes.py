"""8-bit range codes (`/s8`, frame format 5) and layers one bit more than the mode (`/k5=`, `/v5=` in int4, `/k3=`,
`/v3=` in int2: a value of UP_BITS in the layer table)."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.frame import LAYER_TABLE, SCALE8
from cachestore.codec.layout import HiLayers
from cachestore.errors import CodecError, ConfigError
from tests.support import check_gate_refuses_others, check_layers_decode_apart, kv_sample, resealed

SHAPE = (4, 2, 3, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]; 40 tokens: 5 key groups of 8


def test_spec_names_range_codes_and_the_bit_more_layers_and_parses_back() -> None:
    spec = CodecSpec.parse("int4+zstd/s8/k8=3/k5=2.0/v5=1")
    assert spec.variant is not None and spec.variant.scale8
    assert spec.hi == HiLayers(keys=(3,), up_keys=(0, 2), up_values=(1,))
    assert spec.name() == "int4+zstd:3/g64/s8/k8=3/k5=0.2/v5=1"
    assert CodecSpec.parse(spec.name()) == spec
    assert CodecSpec.parse("int2/rotv/clip/s8/k3=4").name() == "int2+lz4/g64/rotv/clip/s8/k3=4"
    assert spec.transform == SCALE8 | LAYER_TABLE
    assert spec.layer_table(4) == bytes((0x45, 0x54, 0x45, 0x48))


@pytest.mark.parametrize("text", ["int4/k3=1", "int2/k5=1", "int8/k5=1", "int4/outk/s8/k8=1", "int2/symv/s8/k4=1",
                                  "int4/k8=1/k5=1", "int2/k4=1/k3=1", "int4/v2=0/v5=0", "int4/outk/k5=1",
                                  "int2/outk/symv/k3=1", "int4/s8/s8", "fp16/s8"])
def test_spec_rejects_bad_range_codes_and_bits(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def _decode(spec: str, kv: torch.Tensor) -> torch.Tensor:
    return Codec().decode(Codec(spec).encode(kv))


@pytest.mark.parametrize(("mode", "variant"), [("int4", "plain"), ("int4", "rot"), ("int2", "rotv/clip"),
                                               ("int2", "plain")])
def test_each_half_takes_the_bits_its_table_gives_and_ranges_are_per_layer(mode: str, variant: str) -> None:
    """A layer one bit more decodes to what a frame with every layer at that precision gives it, the mode's layers
    to what the codec without a table gives them (the range codes' extremes are per layer, head and group), int8
    layers to int8's."""
    kv = kv_sample(SHAPE, torch.float32, seed=5)
    up = {"int4": 5, "int2": 3}[mode]
    every = ".".join(map(str, range(SHAPE[0])))
    for s8 in (False, True):
        options = ("s8" if variant == "plain" else f"{variant}/s8") if s8 else variant
        frame = Codec(f"{mode}+zstd/g8/{options}/k8=3/k{up}=0.2/v{up}=1").encode(kv)
        header = read_header(frame)
        assert header.version == (5 if s8 else 3)
        own = {"int4": 4, "int2": 2}[mode]
        assert header.layer_bits == bytes((up | own << 4, own | up << 4, up | own << 4, 8 | own << 4))
        out = Codec().decode(frame)
        mine = _decode(f"{mode}+zstd/g8/{options}", kv)
        more = _decode(f"{mode}+zstd/g8/{options}/k{up}={every}/v{up}={every}", kv)
        int8 = _decode("int8+zstd", kv)
        for layer in range(SHAPE[0]):
            for half in (0, 1):
                want = (int8 if (layer, half) == (3, 0) else more if (layer, half) in {(0, 0), (2, 0), (1, 1)}
                        else mine)
                assert torch.equal(out[layer, half], want[layer, half]), (s8, layer, half)


@pytest.mark.parametrize("options", ["rotv/clip/outk/symv/s8", "outk/s8", "symv/s8"])
def test_split_frames_take_range_codes_and_layers_one_bit_more(options: str) -> None:
    """Outlier key channels and symmetric values with range codes (format 5): a raised layer decodes to what the frame
    with every layer raised gives it, the others to what the frame without a table gives them."""
    kv = kv_sample(SHAPE, torch.float32, seed=9)
    every = ".".join(map(str, range(SHAPE[0])))
    frame = Codec(f"int2+zstd/g8/{options}/k3=0.2/v3=1").encode(kv)
    header = read_header(frame)
    assert header.version == 5 and header.layer_bits == bytes((0x23, 0x32, 0x23, 0x22))
    out = Codec().decode(frame)
    mine = _decode(f"int2+zstd/g8/{options}", kv)
    more = _decode(f"int2+zstd/g8/{options}/k3={every}/v3={every}", kv)
    for layer in range(SHAPE[0]):
        for half in (0, 1):
            want = more if (layer, half) in {(0, 0), (2, 0), (1, 1)} else mine
            assert torch.equal(out[layer, half], want[layer, half]), (layer, half)
    err = {name: float((x - kv).abs().mean()) for name, x in (("mine", mine), ("more", more))}
    assert err["more"] < 0.75 * err["mine"]
    plain = Codec(f"int2+zstd/g8/{options.replace('/s8', '')}").encode(kv)
    assert read_header(plain).version == 4 and read_header(plain).raw_len > read_header(Codec(
        f"int2+zstd/g8/{options}").encode(kv)).raw_len


def test_one_bit_more_halves_the_error_and_range_codes_cost_little_of_it() -> None:
    kv = kv_sample((2, 2, 2, 64, 64), torch.float32, seed=1)
    err = {spec: float((_decode(spec, kv) - kv).abs().mean())
           for spec in ("int4+none/plain", "int4+none/s8", "int4+none/k5=0.1/v5=0.1", "int4+none/s8/k5=0.1/v5=0.1",
                        "int2+none/plain", "int2+none/s8", "int2+none/plain/k3=0.1/v3=0.1")}
    assert err["int4+none/k5=0.1/v5=0.1"] < 0.6 * err["int4+none/plain"]
    assert err["int2+none/plain/k3=0.1/v3=0.1"] < 0.6 * err["int2+none/plain"]
    for mode in ("int4", "int2"):  # codes of the range between the block's extremes: at most 2 of 255 steps wider
        assert err[f"{mode}+none/plain"] <= err[f"{mode}+none/s8"] < 1.05 * err[f"{mode}+none/plain"]
    assert err["int4+none/s8/k5=0.1/v5=0.1"] < 1.05 * err["int4+none/k5=0.1/v5=0.1"]


def test_every_value_lies_within_half_a_step_of_its_coded_range() -> None:
    """The contract of an affine code: |x - decoded| <= scale / 2 (plus the fp16 rounding of scale and zero), with
    the scale and zero point the range codes expand to, and no value outside its group's coded range."""
    kv = kv_sample(SHAPE, torch.float32, seed=7)
    frame = Codec("int4+none/g8/s8").encode(kv)
    opened = Codec().open(frame)
    sk, zk, sv, zv = (p.float() for p in opened.parts[:4])  # expanded: [L, H, 5, 1, D] and [L, H, T, 2, 1]
    out = opened.decode_into()
    layers, _, heads, tokens, dim = SHAPE
    k, kd = kv[:, 0].reshape(layers, heads, 5, 8, dim), out[:, 0].reshape(layers, heads, 5, 8, dim)
    v, vd = kv[:, 1].reshape(layers, heads, tokens, 2, 8), out[:, 1].reshape(layers, heads, tokens, 2, 8)
    for x, xd, scale, zero in ((k, kd, sk, zk), (v, vd, sv, zv)):
        slack = scale * 2.0**-9 + zero.abs() * 2.0**-10
        assert bool(((x - xd).abs() <= scale / 2 + slack).all())
        assert bool((x >= zero - slack).all()) and bool((x <= zero + 15 * scale + slack).all())


def test_range_codes_save_a_quarter_bit_a_value() -> None:
    kv = kv_sample((30, 2, 3, 64, 64), torch.float16)
    for mode, bits in (("int4", 4), ("int2", 2)):
        plain, s8 = (read_header(Codec(f"{mode}+none/{o}").encode(kv)).raw_len for o in ("plain", "s8"))
        values = kv.numel()
        assert (plain - s8) * 8 / values == pytest.approx(0.25, abs=0.01), mode
        assert s8 * 8 / values == pytest.approx(bits + 0.25, abs=0.01)


@pytest.mark.parametrize("spec", ["int2/g8/rotv/clip/s8/k3=1.2", "int2/g5/symv/s8/v3=2",
                                  "int4+zstd/g5/s8/k8=0/v2=1/k5=2.3/v5=0",
                                  "int4/g8/plain/k5=1/v5=2", "int2/g5/s8/v3=0.3"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 3)))


def test_frames_without_a_table_or_with_outlier_channels_decode_apart() -> None:
    """Plain int4 codes split by layer in these shapes only; outlier channels need a head_dim of 8s or 16s."""
    for spec in ("int4/g8/s8", "int2/g8/rotv/clip/s8", "int2/g8/rotv/clip/outk/symv/s8/k3=1.2/v3=0.3",
                 "int4/g8/outk/s8/k5=3"):
        check_layers_decode_apart(spec, ((4, 2, 2, 40, 16),))


def test_a_layer_the_kv_lacks_is_refused() -> None:
    with pytest.raises(CodecError, match="layers"):
        Codec("int4/s8/k5=4").encode(kv_sample(SHAPE, torch.float32))
    with pytest.raises(ConfigError, match="layer 7 at 3 bits"):
        CodecSpec.parse("int2/k3=7").check_layers(4)


def test_a_pod_refuses_frames_of_other_range_codes_or_bits_before_decoding() -> None:
    check_gate_refuses_others("int4+zstd/s8/k5=1", ("int4+zstd/k5=1", "int4+zstd/s8/k5=2", "int4+zstd/s8",
                                                   "int4+zstd/s8/v5=1", "int4+zstd/s8/k8=1"), SHAPE)


def test_corrupt_range_extremes_decode_to_finite_values_or_fail_cleanly() -> None:
    """Range codes are bytes like any other: an extreme that is NaN or infinite in fp16 must not crash the decoder."""
    from cachestore.codec.frame import HEADER_SIZE  # noqa: PLC0415

    frame = bytearray(Codec("int4+none/g8/s8").encode(kv_sample((1, 2, 1, 8, 8), torch.float32)))
    frame[HEADER_SIZE:HEADER_SIZE + 2] = b"\xff\x7f"  # the first key extreme: NaN
    try:
        out = Codec().decode(resealed(frame))
    except CodecError:
        return
    assert out.shape == (1, 2, 1, 8, 8)


def test_kv_beyond_the_fp16_range_is_refused_cleanly() -> None:
    kv = kv_sample((1, 2, 1, 8, 8), torch.float32)
    kv[0, 0, 0, 3, 2] = 1e6
    with pytest.raises(CodecError, match="fp16 range"):
        Codec("int4/s8").encode(kv)
