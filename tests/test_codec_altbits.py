"""int2 frames that give some layers' keys or values int4, int4 frames that give some int2 (`/k4=`, `/v4=`, `/k2=`,
`/v2=`: the other grouped precision in the layer table of frame format 3)."""

from __future__ import annotations

import pytest
import torch

from cachestore.codec import Codec, CodecSpec, read_header
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.frame import HEADER_SIZE, LAYER_TABLE
from cachestore.codec.layout import HiLayers
from cachestore.errors import CodecError, ConfigError
from tests.support import check_gate_refuses_others, check_layers_decode_apart, error_bound, kv_sample, resealed

SHAPE = (4, 2, 3, 40, 16)  # [layers, 2, kv_heads, tokens, head_dim]


def test_spec_names_the_other_precision_and_parses_back() -> None:
    spec = CodecSpec.parse("int2+zstd/k8=0/k4=3.1/v4=2")
    assert spec.hi == HiLayers(keys=(0,), values=(), alt_keys=(1, 3), alt_values=(2,))
    assert spec.name() == "int2+zstd:3/g64/rotv/clip/k8=0/k4=1.3/v4=2"
    assert CodecSpec.parse(spec.name()) == spec
    assert CodecSpec.parse("int4/v2=5").hi == HiLayers(alt_values=(5,))
    assert CodecSpec.parse("int4/v2=5").name() == "int4+lz4/g64/plain/v2=5"
    names = {BlockCodecs.for_spec(s).name() for s in ("int2", "int2/k4=1", "int2/v4=1", "int2/k8=1", "int2/k4=2")}
    assert len(names) == 5  # part of the fingerprint


@pytest.mark.parametrize("text", ["int2/k2=1", "int4/k4=1", "int2/v2=0", "int8/k4=1", "int2/k4=1/k8=2",
                                  "int2/v4=1/k4=2", "int2/k8=1/k4=1", "int2/v8=3/v4=3", "int2/k4=1.1", "int2/k4="])
def test_spec_rejects_bad_precisions(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


@pytest.mark.parametrize(("mode", "alt", "variant"), [("int2", "int4", "plain"), ("int2", "int4", "rotv/clip"),
                                                      ("int4", "int2", "plain"), ("int4", "int2", "rot")])
def test_each_half_takes_the_precision_its_table_gives(mode: str, alt: str, variant: str) -> None:
    """Layers at the other precision decode to what that mode's codec gives them (same group, same options), the
    mode's layers to what it gives them, int8 layers within int8's bound; the table says so byte by byte."""
    kv = kv_sample(SHAPE, torch.float32, seed=3)
    alt_bits = {"int4": 4, "int2": 2}[alt]
    frame = Codec(f"{mode}+zstd/g8/{variant}/k8=2/k{alt_bits}=1.3/v{alt_bits}=0").encode(kv)
    header = read_header(frame)
    assert (header.version, header.transform & LAYER_TABLE) == (3, LAYER_TABLE)
    own = {"int4": 4, "int2": 2}[mode]
    assert header.layer_bits == bytes((own | alt_bits << 4, alt_bits | own << 4, 8 | own << 4, alt_bits | own << 4))
    out = Codec().decode(frame)
    mine = Codec().decode(Codec(f"{mode}+zstd/g8/{variant}").encode(kv))
    other = Codec().decode(Codec(f"{alt}+zstd/g8/{variant}").encode(kv))
    int8_bound = error_bound("int8", kv, 8) + 1e-6
    at_alt = {(1, 0), (3, 0), (0, 1)}
    for layer in range(SHAPE[0]):
        for half in (0, 1):
            if (layer, half) == (2, 0):
                assert bool(((out[2, 0] - kv[2, 0]).abs() <= int8_bound[2, 0]).all())
            else:
                want = other if (layer, half) in at_alt else mine
                assert torch.allclose(out[layer, half], want[layer, half], rtol=1e-6, atol=1e-6), (layer, half)
    if alt == "int4" and variant == "plain":  # within int4's bound there
        bound = error_bound("int4", kv, 8) + 1e-6
        assert bool(((out[1, 0] - kv[1, 0]).abs() <= bound[1, 0]).all())


@pytest.mark.parametrize("spec", ["int2/g8/plain/k4=1.3/v4=0.1", "int2+zstd/g5/plain/k8=0/k4=2", "int4/g32/rot/v2=2",
                                  "int2/g8/rotv/clip/k8=0/v8=3/k4=1.2/v4=0.1.2", "int4/g8/k8=3/k2=0.1/v2=1.2.3"])
def test_layers_decode_apart_into_strided_views_as_whole(spec: str) -> None:
    check_layers_decode_apart(spec, ((4, 2, 2, 40, 16), (4, 2, 1, 7, 3)))


def test_an_int4_layer_in_an_int2_frame_costs_about_its_share_of_the_bytes() -> None:
    kv = kv_sample((30, 2, 3, 64, 64), torch.float16)
    plain = len(Codec("int2+none/plain").encode(kv))
    one = len(Codec("int2+none/plain/k4=0/v4=0").encode(kv))
    int4 = len(Codec("int4+none/plain").encode(kv))
    assert one - plain == pytest.approx((int4 - plain) / 30, rel=0.05)


def _alt_frame() -> bytearray:
    return bytearray(Codec("int2+none/g8/plain/k4=1").encode(kv_sample((2, 2, 1, 8, 8), torch.float32)))


@pytest.mark.parametrize(("edit", "match"), [
    ({HEADER_SIZE: 0x25}, "layer table"),  # 5 bits for keys: none of 2, 3, 4, 8
    ({HEADER_SIZE + 1: 0x26}, "layer table"),  # 6 bits
    ({HEADER_SIZE + 1: 0x22}, "raises no layer"),  # every layer the mode's
    ({HEADER_SIZE: 0x24}, "raw length"),  # a second int4 half: another layout than the payload's
    ({HEADER_SIZE + 1: 0x28}, "raw length"),  # the int4 half made int8
])
def test_bad_tables_of_other_precisions_are_refused_cleanly(edit: dict[int, int], match: str) -> None:
    frame = _alt_frame()
    assert read_header(bytes(frame)).layer_bits == bytes((0x22, 0x24))
    assert Codec().decode(bytes(frame)).shape == (2, 2, 1, 8, 8)
    for offset, value in edit.items():
        frame[offset] = value
    with pytest.raises(CodecError, match=match):
        Codec().decode(resealed(frame))


def test_a_layer_the_kv_lacks_is_refused() -> None:
    with pytest.raises(CodecError, match="layers"):
        Codec("int2/v4=4").encode(kv_sample(SHAPE, torch.float32))
    with pytest.raises(ConfigError, match="layer 7 at 4 bits"):
        CodecSpec.parse("int2/k4=7").check_layers(4)


def test_a_pod_refuses_frames_of_another_bit_allocation_before_decoding() -> None:
    check_gate_refuses_others("int2+zstd/rot/clip/k4=1", ("int2+zstd/rot/clip/k4=2", "int2+zstd/rot/clip/v4=1",
                                                         "int2+zstd/rot/clip/k8=1", "int2+zstd/rot/clip"), SHAPE)
