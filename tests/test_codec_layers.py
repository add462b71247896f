"""int4/int2 frames that keep some layers' keys or values at int8 (`/k8=`, `/v8=`, frame format 3)."""

from __future__ import annotations

import struct

import pytest
import torch

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.frame import HEADER_SIZE, LAYER_TABLE
from cachestore.codec.layout import NO_HI, HiLayers
from cachestore.errors import CodecError, ConfigError
from tests.support import check_gate_refuses_others, check_layers_decode_apart, error_bound, kv_sample, resealed

SHAPE = (4, 2, 3, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]


def test_spec_names_the_int8_layers_and_parses_back() -> None:
    spec = CodecSpec.parse("int4+zstd/k8=3.1/v8=0")
    assert spec.hi == HiLayers(keys=(1, 3), values=(0,))
    assert spec.name() == "int4+zstd:3/g64/plain/k8=1.3/v8=0"
    assert CodecSpec.parse(spec.name()) == spec
    for text in ("int4/g32/rot/k8=2", "int2+lz4/g8/rotv/clip/v8=5.7", "int4+none/plain/k8=0/v8=0"):
        assert CodecSpec.parse(CodecSpec.parse(text).name()) == CodecSpec.parse(text)
    assert CodecSpec.parse("int4/k8=2").variant == CodecSpec.parse("int4").variant  # orthogonal to options
    assert CodecSpec("int8", hi=HiLayers((1,), ())) == CodecSpec("int8")  # ignored where it has no meaning
    assert CodecSpec("int4", hi=HiLayers((3, 1, 3), ())).hi == HiLayers((1, 3), ())  # sorted, distinct


@pytest.mark.parametrize("text", ["int8/k8=1", "int4/k8=1.1", "int4/k8=", "int4/k8=a", "int4/v8=1/k8=2",
                                  "int4/k8=1/k8=2", "int4/k8=-1", "int4/k8=99999", "fp8/v8=0",
                                  "int4/k8=" + "9" * 5000])
def test_spec_rejects_bad_layer_lists(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def test_the_layers_are_part_of_the_fingerprint() -> None:
    names = {BlockCodecs.for_spec(s).name() for s in ("int4+zstd", "int4+zstd/k8=1", "int4+zstd/k8=2",
                                                       "int4+zstd/v8=1", "int4+zstd/k8=1/v8=1")}
    assert len(names) == 5
    codecs = BlockCodecs.for_spec("int4+zstd/k8=1")
    assert codecs.name() == "int4+zstd:3/g64/plain/k8=1,sink=int8+zstd:3"
    assert codecs.sink.spec.hi == NO_HI  # the sink block is int8 throughout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("mode", "group"), [("int4", 8), ("int2", 8), ("int4", 64)])
def test_each_half_keeps_its_own_precision(mode: str, group: int, dtype: torch.dtype) -> None:
    """Keys of layers 1 and 3 and values of layers 0 and 1 within int8's bound, the rest within the grouped
    mode's; and the int8 halves really are int8 (their error far below what the grouped mode gives there)."""
    kv = kv_sample(SHAPE, dtype, seed=5)
    x = kv.float()
    frame = Codec(f"{mode}+zstd/g{group}/plain/k8=1.3/v8=0.1").encode(kv)
    header = read_header(frame)
    assert (header.version, header.transform) == (3, LAYER_TABLE)
    lo, hi = {"int4": 4, "int2": 2}[mode], 8
    assert header.layer_bits == bytes((lo | hi << 4, hi | hi << 4, lo | lo << 4, hi | lo << 4))
    out = Codec().decode(frame).float()
    plain = Codec(f"{mode}+zstd/g{group}/plain").decode(Codec(f"{mode}+zstd/g{group}/plain").encode(kv)).float()
    out_eps = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    slack = (x.abs() + 1) * (out_eps + 2.0**-10) + 1e-6
    int8_bound, grouped_bound = error_bound("int8", x, group) + slack, error_bound(mode, x, group) + slack
    hi_halves = {(1, 0), (3, 0), (0, 1), (1, 1)}
    for layer in range(SHAPE[0]):
        for half in (0, 1):
            err = (out[layer, half] - x[layer, half]).abs()
            if (layer, half) in hi_halves:
                assert bool((err <= int8_bound[layer, half]).all()), (layer, half)
                assert err.max() < 0.25 * (plain[layer, half] - x[layer, half]).abs().max(), (layer, half)
            else:
                assert bool((err <= grouped_bound[layer, half]).all()), (layer, half)
                assert torch.equal(out[layer, half], plain[layer, half]), (layer, half)  # same codes as without


@pytest.mark.parametrize("spec", ["int4/g8/k8=1.3/v8=0.1", "int2+zstd/g5/plain/k8=0", "int4/g32/rot/v8=2",
                                  "int2/g8/rotv/clip/k8=0.1.2.3/v8=0.1.2.3"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    """Any range of layers, any output dtype, a slice of a larger context; odd shapes whose codes end
    mid-byte (g5 int2, head_dim 3) included: each layer's codes start on a byte in these frames."""
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 3)))
    for shape in ((4, 2, 2, 40, 16), (4, 2, 1, 7, 3)):
        frame = Codec(spec).encode(torch.randn(*shape, generator=torch.Generator().manual_seed(2)))
        half = torch.empty(shape, dtype=torch.float16)
        Codec().decode_into(frame, half)
        assert torch.allclose(half.float(), Codec().decode(frame), rtol=2.0**-10, atol=1e-4)


def test_frames_without_int8_layers_are_unchanged() -> None:
    """No layer raised: the very frame of the codec without the option (format 1 or 2, no table)."""
    kv = kv_sample(SHAPE, torch.float32)
    for text in ("int4+zstd/g8/plain", "int2/g8/rotv/clip"):
        spec = CodecSpec.parse(text)
        assert CodecSpec(spec.mode, spec.compressor, spec.level, spec.group_size, spec.variant, NO_HI) == spec
        assert read_header(Codec(spec).encode(kv)).version in (1, 2)
        assert read_header(Codec(spec).encode(kv)).layer_bits == b""


def test_a_layer_the_kv_lacks_is_refused_at_encode() -> None:
    with pytest.raises(CodecError, match="layers"):
        Codec("int4/k8=4").encode(kv_sample(SHAPE, torch.float32))


def test_one_int8_layer_costs_about_its_share_of_the_bytes() -> None:
    kv = kv_sample((30, 2, 3, 64, 64), torch.float16)
    plain = len(Codec("int4+none/plain").encode(kv))
    one = len(Codec("int4+none/plain/k8=0/v8=0").encode(kv))
    int8 = len(Codec("int8+none").encode(kv))
    assert one - plain == pytest.approx((int8 - plain) / 30, rel=0.05)


def _table_frame() -> bytearray:
    return bytearray(Codec("int4+none/g8/k8=1/v8=0").encode(kv_sample((2, 2, 1, 8, 8), torch.float32)))


@pytest.mark.parametrize(("edit", "match"), [
    ({HEADER_SIZE: 0x33}, "layer table"),  # 3 bits: neither int4 nor int8
    ({HEADER_SIZE: 0x94}, "layer table"),  # 9 bits for values
    ({HEADER_SIZE: 0x44, HEADER_SIZE + 1: 0x44}, "raises no layer"),  # nothing needing version 3
    ({HEADER_SIZE: 0x88}, "raw length"),  # another layout than the payload's (one more int8 half)
    ({9: 0}, "transform 0x0 in version 3"),  # version 3 without its table bit
    ({4: 2}, "transform 0x4 in version 2"),  # a table in a version 2 frame
    ({9: LAYER_TABLE | 0x40}, "transform 0x44 in version 3"),  # a bit of format 6 in a version 3 frame
    ({4: 5}, "version 5"),  # a newer format altogether
])
def test_bad_layer_tables_are_refused_cleanly(edit: dict[int, int], match: str) -> None:
    frame = _table_frame()
    assert Codec().decode(bytes(frame)).shape == (2, 2, 1, 8, 8)
    for offset, value in edit.items():
        frame[offset] = value
    with pytest.raises(CodecError, match=match):
        Codec().decode(resealed(frame))


def test_a_frame_cut_inside_its_layer_table_is_refused() -> None:
    frame = _table_frame()
    with pytest.raises(CodecError, match="layer table"):
        read_header(bytes(frame[:HEADER_SIZE + 1]))
    frame[36:44] = struct.pack("<Q", 1)  # a payload too short to hold the table, sealed
    with pytest.raises(CodecError, match="layer table"):
        Codec().decode(resealed(frame[:HEADER_SIZE + 1]))


def test_a_frame_with_other_int8_layers_is_refused_before_decoding() -> None:
    check_gate_refuses_others("int4/k8=1", ("int4/k8=2", "int4/v8=1", "int4"), SHAPE)


def test_a_pod_refuses_int8_layers_its_model_lacks_in_one_line() -> None:
    """/k8= layers are one model's calibration: a pod of a smaller model exits at start-up with one line (it would
    otherwise drop every write), and the check itself accepts every layer the model has."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    CodecSpec.parse("int4+zstd/k8=0.1").check_layers(2)
    with pytest.raises(ConfigError, match="layers 0-1"):
        CodecSpec.parse("int4+zstd/v8=2").check_layers(2)
    done = subprocess.run([sys.executable, "-m", "ops.cli", "serve", "--model", "tiny-random", "--codec",
                           "int4+zstd/k8=18.20", "--no-cache", "--port", "1"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "kvstash: error: codec int4+zstd:3/g64/plain/k8=18.20 keeps layer 20 at int8, but the model has layers "
        "0-1: /k8= and /v8= name one model's layers")


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
