"""8-bit range codes (`/s8`, frame format 5, with a split layout: /outk, /symv or /kbits) and layers one bit more than
the mode (`/k5=`, `/v5=` in int4, `/k3=`, `/v3=` in int2: a value of UP_BITS in the layer table)."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.frame import LAYER_TABLE, OUTLIER_KEYS, SCALE8
from cachestore.codec.layout import HiLayers
from cachestore.errors import CodecError, ConfigError
from tests.support import check_gate_refuses_others, check_layers_decode_apart, kv_sample, resealed

SHAPE = (4, 2, 3, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]; 40 tokens: 5 key groups of 8


def test_spec_names_range_codes_and_the_bit_more_layers_and_parses_back() -> None:
    spec = CodecSpec.parse("int4+zstd/outk/s8/k5=2.0/v5=1")
    assert spec.variant is not None and spec.variant.scale8
    assert spec.hi == HiLayers(up_keys=(0, 2), up_values=(1,))
    assert spec.name() == "int4+zstd:3/g64/outk/s8/k5=0.2/v5=1"
    assert CodecSpec.parse(spec.name()) == spec
    assert CodecSpec.parse("int2/rotv/clip/symv/s8/k3=4").name() == "int2+lz4/g64/rotv/clip/symv/s8/k3=4"
    assert spec.transform == OUTLIER_KEYS | SCALE8 | LAYER_TABLE
    assert spec.layer_table(4) == bytes((0x45, 0x54, 0x45, 0x44))


@pytest.mark.parametrize("text", ["int4/k3=1", "int2/k5=1", "int8/k5=1", "int4/outk/s8/k8=1", "int2/symv/s8/k4=1",
                                  "int4/s8", "int4/s8/k5=1", "int4/outk/k5=1", "int4/rot", "int4/rotk", "fp8",
                                  "int2/outk/symv/k3=1", "int4/outk/s8/s8", "fp16/s8", "int2/symv/s8/v2=1"])
def test_spec_rejects_bad_range_codes_and_bits(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def _decode(spec: str, kv: torch.Tensor) -> torch.Tensor:
    return Codec().decode(Codec(spec).encode(kv), device="cpu")


@pytest.mark.parametrize("options", ["rotv/clip/outk/symv/s8", "outk/s8", "symv/s8"])
def test_split_frames_take_range_codes_and_layers_one_bit_more(options: str) -> None:
    """Outlier key channels and symmetric values with range codes (format 5): a raised layer decodes to what the frame
    with every layer raised gives it, the others to what the frame without a table gives them."""
    kv = kv_sample(SHAPE, torch.float32, seed=9)
    every = ".".join(map(str, range(SHAPE[0])))
    frame = Codec(f"int2+zstd/g8/{options}/k3=0.2/v3=1").encode(kv)
    header = read_header(frame)
    assert header.version == 5 and header.layer_bits == bytes((0x23, 0x32, 0x23, 0x22))
    out = Codec().decode(frame, device="cpu")
    mine = _decode(f"int2+zstd/g8/{options}", kv)
    more = _decode(f"int2+zstd/g8/{options}/k3={every}/v3={every}", kv)
    for layer in range(SHAPE[0]):
        for half in (0, 1):
            want = more if (layer, half) in {(0, 0), (2, 0), (1, 1)} else mine
            assert torch.equal(out[layer, half], want[layer, half]), (layer, half)
    err = {name: float((x - kv).abs().mean()) for name, x in (("mine", mine), ("more", more))}
    assert err["more"] < 0.75 * err["mine"]


def test_one_bit_more_halves_the_error() -> None:
    kv = kv_sample((2, 2, 2, 64, 64), torch.float32, seed=1)
    err = {spec: float((_decode(spec, kv) - kv).abs().mean())
           for spec in ("int4+none/symv/s8", "int4+none/symv/s8/k5=0.1/v5=0.1", "int2+none/symv/s8",
                        "int2+none/symv/s8/k3=0.1/v3=0.1")}
    assert err["int4+none/symv/s8/k5=0.1/v5=0.1"] < 0.6 * err["int4+none/symv/s8"]
    assert err["int2+none/symv/s8/k3=0.1/v3=0.1"] < 0.6 * err["int2+none/symv/s8"]


def test_every_key_lies_within_half_a_step_of_its_coded_range() -> None:
    """The contract of an affine code: |x - decoded| <= scale / 2 (plus the fp16 rounding of scale and zero), with
    the scale and zero point the range codes expand to, and no value outside its group's coded range."""
    kv = kv_sample(SHAPE, torch.float32, seed=7)
    opened = Codec().open(Codec("int4+none/g8/symv/s8").encode(kv), device="cpu")
    sk, zk = (p.float() for p in opened.parts[:2])  # expanded: [L, H, 5, 1, D]
    out = opened.decode_into()
    layers, _, heads, _, dim = SHAPE
    k, kd = kv[:, 0].reshape(layers, heads, 5, 8, dim), out[:, 0].reshape(layers, heads, 5, 8, dim)
    slack = sk * 2.0**-9 + zk.abs() * 2.0**-10
    assert bool(((k - kd).abs() <= sk / 2 + slack).all())
    assert bool((k >= zk - slack).all()) and bool((k <= zk + 15 * sk + slack).all())


@pytest.mark.parametrize("spec", ["int2/g8/rotv/clip/symv/s8/k3=1.2", "int2/g5/symv/s8/v3=2",
                                  "int4+zstd/g5/symv/s8/k5=2.3/v5=0", "int2/g5/symv/s8/v3=0.3"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 3)))


def test_frames_without_a_table_or_with_outlier_channels_decode_apart() -> None:
    """Plain int4 codes split by layer in these shapes only; outlier channels need a head_dim of 8s or 16s."""
    for spec in ("int4/g8/symv/s8", "int2/g8/rotv/clip/symv/s8", "int2/g8/rotv/clip/outk/symv/s8/k3=1.2/v3=0.3",
                 "int4/g8/outk/s8/k5=3"):
        check_layers_decode_apart(spec, ((4, 2, 2, 40, 16),))


def test_a_layer_the_kv_lacks_is_refused() -> None:
    with pytest.raises(CodecError, match="layers"):
        Codec("int4/symv/s8/k5=4").encode(kv_sample(SHAPE, torch.float32))
    with pytest.raises(ConfigError, match="layer 7 3 bits"):
        CodecSpec.parse("int2/symv/s8/k3=7").check_layers(4)


def test_a_pod_refuses_frames_of_other_range_codes_or_bits_before_decoding() -> None:
    check_gate_refuses_others("int4+zstd/symv/s8/k5=1", ("int4+zstd/symv/s8/k5=2", "int4+zstd/symv/s8",
                                                        "int4+zstd/symv/s8/v5=1", "int4+zstd/outk/s8/k5=1"), SHAPE)


def test_corrupt_range_extremes_decode_to_finite_values_or_fail_cleanly() -> None:
    """Range codes are bytes like any other: an extreme that is NaN or infinite in fp16 must not crash the decoder."""
    from cachestore.codec.frame import HEADER_SIZE  # noqa: PLC0415

    frame = bytearray(Codec("int4+none/g8/symv/s8").encode(kv_sample((1, 2, 1, 8, 8), torch.float32)))
    frame[HEADER_SIZE:HEADER_SIZE + 2] = b"\xff\x7f"  # the first key extreme: NaN
    try:
        out = Codec().decode(resealed(frame), device="cpu")
    except CodecError:
        return
    assert out.shape == (1, 2, 1, 8, 8)


def test_kv_beyond_the_fp16_range_is_refused_cleanly() -> None:
    kv = kv_sample((1, 2, 1, 8, 8), torch.float32)
    kv[0, 0, 0, 3, 2] = 1e6
    with pytest.raises(CodecError, match="fp16 range"):
        Codec("int4/symv/s8").encode(kv)


def test_a_pod_refuses_layers_its_model_lacks_in_one_line() -> None:
    """Layers one bit more are one model's calibration: a pod of a smaller model exits at start-up with one line (it
    would otherwise drop every write), and the check itself accepts every layer the model has."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    CodecSpec.parse("int4+zstd/kbits/s8/v5=0.1").check_layers(2)
    with pytest.raises(ConfigError, match="layers 0-1"):
        CodecSpec.parse("int4+zstd/kbits/s8/v5=2").check_layers(2)
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--codec",
                           "int4+zstd/symv/s8/k5=18.20", "--no-cache", "--port", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "kvstash: error: codec int4+zstd:3/g64/symv/s8/k5=18.20 gives layer 20 5 bits, but the model has layers "
        "0-1: /k5= and /v5= name one model's layers")


def test_a_pod_refuses_q8_for_a_head_dim_it_cannot_quantize_in_one_line() -> None:
    """q8 quantizes 32 channels of one head at a time: a model whose head_dim is no multiple (the tiny test model's
    is 16) makes the pod exit at start-up with one line."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    CodecSpec.parse("q8").check_model(30, 64)
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--codec", "q8",
                           "--no-cache", "--port", "1"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "kvstash: error: codec q8 quantizes blocks of 32 channels of one head, but the model's head_dim is 16")
