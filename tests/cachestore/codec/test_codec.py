"""Round trips and error bounds of every codec mode x compressor x dtype, and the spec syntax."""

from __future__ import annotations

import itertools

import pytest
import torch
import zstandard

from cachestore.codec import DEFAULT_VARIANTS, Codec, CodecSpec, read_header, verify_frame, verify_placed
from cachestore.codec.compress import compress, compress_sections, decompress
from cachestore.codec.layout import PLAIN, Variant
from cachestore.codec.quant import rotate
from cachestore.errors import CodecError, ConfigError
from tests.support import error_bound, kv_sample

MODES = ["exact", "fp16", "int8", "int4", "int2"]
COMPRESSORS = ["none", "lz4", "zstd"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# [layers, 2, kv_heads, tokens, head_dim]: ordinary, 1 token, tokens not a multiple of the
# group, 1 head and 1 layer, head_dim not a multiple of the group.
SHAPES = [(2, 2, 3, 40, 16), (1, 2, 1, 1, 8), (2, 2, 2, 13, 8), (1, 2, 1, 37, 12)]


@pytest.mark.parametrize(("mode", "compressor", "dtype"),
                         list(itertools.product(MODES, COMPRESSORS, DTYPES)))
def test_round_trip_within_contract(mode: str, compressor: str, dtype: torch.dtype) -> None:
    codec = Codec(CodecSpec(mode=mode, compressor=compressor, group_size=8, variant=PLAIN))
    for i, shape in enumerate(SHAPES):
        kv = kv_sample(shape, dtype, seed=i)
        frame = codec.encode(kv)
        out = Codec("exact").decode(frame, device="cpu")  # any codec decodes any frame
        assert out.shape == kv.shape and out.dtype == dtype and out.device.type == "cpu"
        assert torch.isfinite(out).all()
        if mode == "exact" or (mode == "fp16" and dtype == torch.float16):
            assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
            continue
        x, y = kv.float(), out.float()
        out_eps = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        if mode == "fp16":
            bound = x.abs() * 2.0**-11 + 2.0**-24
        else:
            bound = error_bound(mode, x, 8) + (x.abs() + 1) * (out_eps + 2.0**-10) + 1e-6
        worst = ((y - x).abs() - bound).max().item()
        assert worst <= 0, f"{mode}/{compressor}/{dtype} shape {shape}: over bound by {worst}"


@pytest.mark.parametrize("mode", ["int8", "int4", "int2"])
def test_bound_is_tight_enough_to_mean_something(mode: str) -> None:
    """A codec that used the wrong grouping would overshoot: the error uses a fair part
    of the bound but never exceeds it."""
    kv = kv_sample((2, 2, 2, 64, 16), torch.float32)
    codec = Codec(CodecSpec(mode=mode, compressor="none", group_size=8, variant=PLAIN))
    out = codec.decode(codec.encode(kv), device="cpu")
    ratio = ((out - kv).abs() / error_bound(mode, kv, 8)).max().item()
    assert 0.3 < ratio <= 1.0


def _slab_norm(x: torch.Tensor) -> torch.Tensor:
    """L2 norm of each [tokens, head_dim] slab of x [L, 2, H, T, D]."""
    return x.square().sum((3, 4)).sqrt()


VARIANTS = {"rotv": Variant(rot_values=True), "clip": Variant(clip=True), "rotv/clip": Variant(True, True)}


@pytest.mark.parametrize("mode", ["int4", "int2"])
@pytest.mark.parametrize("option", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotated_and_clipped_variants_within_contract(mode: str, option: str, dtype: torch.dtype) -> None:
    """The contract of the options: the rotation is orthonormal along head_dim, so each [tokens, head_dim]
    slab's error norm is that of the quantization in the rotated space, which is at most the norm of the
    half-steps of the rotated data's groups; clipping keeps, per group, the range of least squared error,
    the unclipped range included, so the same norm bounds it."""
    variant = VARIANTS[option]
    codec = Codec(CodecSpec(mode=mode, compressor="lz4", group_size=8, variant=variant))
    for i, shape in enumerate(SHAPES):
        kv = kv_sample(shape, dtype, seed=i)
        frame = codec.encode(kv)
        assert read_header(frame).version == (2 if variant.rot_values else 1)
        out = Codec("exact").decode(frame, device="cpu")
        assert out.shape == kv.shape and out.dtype == dtype and torch.isfinite(out).all()
        x = kv.float()
        xr = torch.stack([x[:, 0], rotate(x[:, 1]) if variant.rot_values else x[:, 1]], 1)
        out_eps = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        bound = _slab_norm(error_bound(mode, xr, 8)) + _slab_norm((x.abs() + 1) * (out_eps + 2.0**-10)) + 1e-5
        worst = (_slab_norm(out.float() - x) - bound).max().item()
        assert worst <= 0, f"{mode}/{option}/{dtype} shape {shape}: over bound by {worst}"


def test_rotation_is_its_own_inverse_and_spreads_an_outlier_channel() -> None:
    for dim in (64, 96, 12, 7):
        x = torch.randn(3, 5, dim)
        assert torch.allclose(rotate(rotate(x)), x, atol=1e-5)
        assert torch.allclose(rotate(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    spike = torch.zeros(1, 64)
    spike[0, 5] = 8.0
    assert rotate(spike).abs().max().item() == pytest.approx(1.0)  # 8 / sqrt(64) in every channel


def test_options_lower_int2_error_on_outlier_channels() -> None:
    """What the options are for: keys and values with a few large channels (as real KV has) lose less."""
    kv = kv_sample((2, 2, 2, 64, 64), torch.float32, seed=3)
    kv[:, :, :, :, :3] *= 12.0
    errs = {}
    for option in ("plain", "rotv", "clip", "rotv/clip"):
        codec = Codec(f"int2+none/g64/{option}")
        errs[option] = float((codec.decode(codec.encode(kv), device="cpu") - kv).norm() / kv.norm())
    assert errs["rotv"] < errs["plain"] and errs["clip"] < errs["plain"], errs
    assert errs["rotv/clip"] < min(errs["rotv"], errs["clip"]), errs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fill", [0.0, 3.25, -1e-3])
def test_constant_and_zero_groups_are_finite(mode: str, fill: float) -> None:
    kv = torch.full((2, 2, 2, 10, 8), fill)
    kv[1, 1, 1] = torch.linspace(-2, 2, 80).view(10, 8)  # one varying head next to them
    out = Codec(CodecSpec(mode=mode, compressor="lz4", group_size=4)).decode(
        Codec(CodecSpec(mode=mode, compressor="lz4", group_size=4)).encode(kv), device="cpu")
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], kv[0], rtol=0, atol=abs(fill) * 2.0**-7 + 1e-9)


def test_group_size_changes_the_frame_and_is_recorded() -> None:
    kv = kv_sample((1, 2, 2, 64, 64), torch.float16)
    f32 = Codec("int4+none/g32/plain").encode(kv)
    f64 = Codec("int4+none/g64/plain").encode(kv)
    assert read_header(f32).group_size == 32 and read_header(f64).group_size == 64
    assert len(f32) > len(f64)  # more groups, more scales
    err32 = (Codec().decode(f32, device="cpu").float() - kv.float()).norm()
    err64 = (Codec().decode(f64, device="cpu").float() - kv.float()).norm()
    assert err32 < err64


def test_sizes_match_the_modes() -> None:
    kv = kv_sample((2, 2, 3, 256, 64), torch.float16)
    fp16_bytes = kv.numel() * 2
    sizes = {m: len(Codec(CodecSpec(mode=m, compressor="none")).encode(kv)) for m in MODES}
    assert sizes["exact"] == sizes["fp16"] == fp16_bytes + 52
    assert fp16_bytes / sizes["int8"] > 1.9
    assert fp16_bytes / sizes["int4"] > 3.5
    assert fp16_bytes / sizes["int2"] > 6.0


def test_decode_to_a_device_and_header_helpers() -> None:
    kv = torch.zeros(1, 2, 2, 5, 8, dtype=torch.bfloat16)
    kv[0, :, :, 0] = 1.5  # compressible, so zstd is kept
    frame = Codec("int8+zstd:5").encode(kv)
    assert Codec().decode(frame, device="cpu").dtype == torch.bfloat16
    header = verify_frame(bytearray(frame))
    assert header.shape == (1, 2, 2, 5, 8)
    assert (header.mode, header.compressor, header.dtype) == ("int8", "zstd", "bfloat16")
    assert read_header(memoryview(frame)[:52]) == header  # header alone is enough
    with pytest.raises(CodecError, match="truncated"):
        verify_frame(frame[:-1])


def test_a_mac_verified_frame_skips_only_its_checksum() -> None:
    """A frame whose bytes a MAC verified is not checksummed again; every other check still runs."""
    frame = bytearray(Codec("int8").encode(torch.randn(2, 2, 1, 4, 8)))
    frame[-1] ^= 0x01  # the checksum no longer matches
    with pytest.raises(CodecError, match="checksum"):
        verify_frame(frame)
    assert verify_frame(frame, mac_verified=True).shape == (2, 2, 1, 4, 8)
    assert Codec().open(frame, mac_verified=True).header.mode == "int8"
    with pytest.raises(CodecError, match="truncated"):
        verify_frame(frame[:-1], mac_verified=True)


def test_encode_rejects_bad_input() -> None:
    codec = Codec()
    for bad in (torch.zeros(2, 3, 1, 4, 8), torch.zeros(2, 2, 1, 0, 8), torch.zeros(2, 2, 4, 8),
                torch.zeros(1, 2, 1, 4, 8, dtype=torch.float64), [1.0]):
        with pytest.raises(CodecError):
            codec.encode(bad)  # type: ignore[arg-type]
    nan = torch.zeros(1, 2, 1, 4, 8)
    nan[0, 0, 0, 1, 1] = float("nan")
    for mode in ("int8", "int4"):
        with pytest.raises(CodecError, match="NaN"):
            Codec(mode).encode(nan)
    assert torch.isnan(Codec("exact").decode(Codec("exact").encode(nan), device="cpu")).sum() == 1


def test_spec_parse_and_name_round_trip() -> None:
    assert CodecSpec.parse("int8") == CodecSpec()
    assert CodecSpec.parse("int4+zstd:3/g32") == CodecSpec("int4", "zstd", 3, 32)
    assert CodecSpec.parse(" INT2+none ") == CodecSpec("int2", "none")
    variants = [None, PLAIN, *VARIANTS.values()]
    for mode, comp, level, group, variant in itertools.product(MODES, COMPRESSORS, (1, 9), (32, 64), variants):
        spec = CodecSpec(mode, comp, level, group, variant)
        assert CodecSpec.parse(spec.name()) == spec
    # options are part of the name (hence of the fingerprint); a bare int4/int2 names its default
    assert CodecSpec.parse("int2/g32/clip/rotv").name() == "int2+lz4/g32/rotv/clip"
    assert CodecSpec.parse("int4/plain").name() == "int4+lz4/g64/plain"
    assert CodecSpec.parse("int2").variant == DEFAULT_VARIANTS["int2"] != PLAIN
    assert CodecSpec.parse("int4").name() == "int4+lz4/g64/plain"
    # fields a mode ignores do not split otherwise identical specs
    assert CodecSpec("int8", "lz4", 7, 32) == CodecSpec("int8", "lz4")
    assert CodecSpec("int8", "lz4", 7, 32).name() == "int8+lz4"
    assert CodecSpec.parse("exact").lossless and not CodecSpec.parse("fp16").lossless


@pytest.mark.parametrize("text", ["", "int3", "int8+gzip", "int8+lz4:3", "int8/g32",
                                  "int4/g2", "int4/g4096", "int4+zstd:99", "int4+zstd:x",
                                  "int4 zstd", "int8/rotv", "int4/spin", "fp8", "int4/rot", "int4/clip/clip",
                                  "int4/plain/clip", "int4/g32/", "exact/plain", "int8/rows", "int4/rows",
                                  "fp16/rows/rows", "fp16/plain/rows"])
def test_spec_parse_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        CodecSpec.parse(text)


def test_incompressible_payloads_are_stored_plainly_and_still_decode() -> None:
    noisy = kv_sample((2, 2, 2, 64, 16), torch.float16)
    smooth = torch.zeros(2, 2, 2, 64, 16, dtype=torch.float16)
    for spec in ("int8+lz4", "fp16+lz4", "exact+lz4"):
        assert read_header(Codec(spec).encode(noisy)).compressor == "none", spec
        assert read_header(Codec(spec).encode(smooth)).compressor == spec[spec.index("+") + 1:][:4]
    assert read_header(Codec("fp16+zstd:1").encode(smooth)).shuffled


def test_decoded_tensors_never_alias_the_frame() -> None:
    kv = kv_sample((1, 2, 2, 9, 8), torch.float32)
    for spec in ("int8+none", "fp16+none", "exact+none", "int4+none/g4"):
        frame = bytearray(Codec(spec).encode(kv))
        before = bytes(frame)
        out = Codec().decode(frame, device="cpu")
        out.fill_(7.0)
        assert bytes(frame) == before, spec
        assert not torch.equal(Codec().decode(frame, device="cpu"), out), spec


@pytest.mark.parametrize("spec", ["fp16+none/rows", "fp16+lz4/rows", "fp16+zstd:1/rows", "exact+none/rows",
                                  "exact+zstd:3/rows"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_token_row_frames_hold_each_layers_rows_and_decode_as_any_frame(spec: str, dtype: torch.dtype) -> None:
    """/rows lays the payload out as [layers, 2, tokens, kv_heads, head_dim] (FLAG_ROWS), the order of a llama.cpp
    state's K and V rows; it decodes to the same tensor as the head-major frame, whole or a few layers at a time."""
    kv = kv_sample((3, 2, 2, 5, 8), dtype)
    frame = Codec(spec).encode(kv)
    header = read_header(frame)
    assert header.rows and CodecSpec.parse(spec).name().endswith("/rows")
    plain = Codec(spec.removesuffix("/rows")).encode(kv)
    assert not read_header(plain).rows
    assert torch.equal(Codec().decode(frame, device="cpu"), Codec().decode(plain, device="cpu"))
    if header.compressor == "none":  # the payload itself is the token rows
        rows = kv.to(torch.float16 if spec.startswith("fp16") else dtype).transpose(2, 3).contiguous()
        assert frame[len(frame) - header.payload_len:] == rows.view(torch.uint8).numpy().tobytes()
    out = torch.zeros(2, 2, 2, 5, 8, dtype=torch.float32)
    Codec().open(frame).decode_into(out, slice(1, 3))
    assert torch.equal(out, Codec().decode(plain, device="cpu")[1:3].float())


def test_only_float_modes_and_q8_carry_token_rows() -> None:
    frame = bytearray(Codec("int8+none").encode(kv_sample((1, 2, 1, 4, 8), torch.float16)))
    frame[8] |= 2  # FLAG_ROWS on an int8 frame
    with pytest.raises(CodecError, match="token rows flag on mode int8"):
        read_header(bytes(frame))
    with pytest.raises(ConfigError, match="exact, fp16, q8 only"):
        CodecSpec("int8", rows=True)
    q8 = bytearray(Codec("q8+none").encode(kv_sample((1, 2, 1, 4, 32), torch.float16)))
    q8[8] &= ~2  # a q8 frame is token rows or nothing
    with pytest.raises(CodecError, match="q8 frame without the token rows flag"):
        read_header(bytes(q8))


def test_q8_is_llama_cpps_q8_0_and_reencodes_its_own_values_byte_for_byte() -> None:
    """q8: token rows of llama.cpp's q8_0 blocks (per token and head, 32 channels: an fp16 scale max|x|/127, then 32
    int8 codes). Error within half a step; its decoded values (exact in fp32) encode to the very same frame, which is
    what lets a llama.cpp pod with a q8_0 cache store and restore it unchanged. Layers decode apart, and into views."""
    spec = CodecSpec.parse("q8")
    assert spec.rows and spec.name() == "q8+lz4" and CodecSpec.parse("q8/rows") == spec
    kv = kv_sample((3, 2, 2, 5, 64), torch.float32)
    codec = Codec("q8+none")
    frame = codec.encode(kv)
    header = read_header(frame)
    assert (header.mode, header.rows, header.dtype) == ("q8", True, "float32")
    assert len(frame) == codec.plain_size((3, 2, 2, 5, 64), torch.float32) == 52 + 3 * 2 * 5 * 2 * 2 * 34
    # the first block: token 0, head 0, channels 0..31 of layer 0's K
    payload = memoryview(frame)[52:]
    block = kv[0, 0, 0, 0, :32]
    scale = torch.frombuffer(bytearray(payload[:2]), dtype=torch.float16)
    codes = torch.frombuffer(bytearray(payload[2:34]), dtype=torch.int8)
    assert scale.item() == (block.abs().max() / 127).half().item()
    assert torch.equal(codes, (block / scale.float()).round().to(torch.int8))
    decoded = codec.decode(frame, device="cpu")
    step = kv.abs().unflatten(-1, (2, 32)).amax(-1, keepdim=True) / 127
    assert ((decoded - kv).abs().unflatten(-1, (2, 32)) <= step * 0.5 + 1e-6).all()
    assert codec.encode(decoded) == frame
    out = torch.full((3, 2, 2, 9, 64), float("nan"))
    Codec().open(frame).decode_into(out[1:3, :, :, 2:7], slice(1, 3))
    assert torch.equal(out[1:3, :, :, 2:7], decoded[1:3]) and out[:, :, :, :2].isnan().all()
    with pytest.raises(CodecError, match="head_dim 24 is no multiple"):
        codec.encode(kv_sample((1, 2, 1, 4, 24), torch.float32))


def test_a_frame_received_in_pieces_verifies_over_them() -> None:
    """verify_placed checks a token-rows frame whose header and payload lie apart, by the checksum of the pieces in
    order (or one computed as they came in: RunningChecksum); anything else, or a flipped bit, is refused."""
    from cachestore.codec.frame import HEADER_SIZE, RunningChecksum, checksum  # noqa: PLC0415

    frame = Codec("fp16+none/rows").encode(kv_sample((2, 2, 2, 4, 8), torch.float16))
    head, payload = memoryview(frame)[:HEADER_SIZE], memoryview(frame)[HEADER_SIZE:]
    pieces = [payload[:100], payload[100:101], payload[101:]]
    assert verify_placed(head, pieces).rows
    running = RunningChecksum()
    for piece in (head, *pieces):
        running(piece)
    assert running.fed == len(frame) and running.value() == checksum(head, payload) == read_header(frame).checksum
    assert verify_placed(head, pieces, digest=running.value()).tokens == 4
    with pytest.raises(CodecError, match="checksum"):
        verify_placed(head, pieces, digest=running.value() ^ 1)
    bad = bytearray(frame)
    bad[-1] ^= 1
    with pytest.raises(CodecError, match="checksum"):
        verify_placed(memoryview(bad)[:HEADER_SIZE], [memoryview(bad)[HEADER_SIZE:]])
    with pytest.raises(CodecError, match="token-rows"):
        verify_placed(head, pieces[:2])  # a payload short of the header's length
    plain = Codec("fp16+none").encode(kv_sample((2, 2, 2, 4, 8), torch.float16))
    with pytest.raises(CodecError, match="token-rows"):
        verify_placed(memoryview(plain)[:HEADER_SIZE], [memoryview(plain)[HEADER_SIZE:]])


def test_a_placed_frame_dequantizes_into_nothing_and_only_where_it_lies() -> None:
    """A PlacedFrame's rows already lie in the context: decoding it writes nothing, into its own place only."""
    from cachestore.codec import PlacedFrame  # noqa: PLC0415

    header = read_header(Codec("fp16+none/rows").encode(kv_sample((3, 2, 2, 4, 8), torch.float16)))
    context = torch.full((3, 2, 2, 12, 8), 5.0, dtype=torch.float16)
    span = context[:, :, :, 4:8]
    placed = PlacedFrame(header, torch.empty(0, dtype=torch.uint8), at=span.data_ptr(),
                         layer_stride=context.stride(0) * 2)
    assert placed.decode_into(span) is span and placed.decode_into(span[1:], slice(1, 3)) is not None
    assert bool((context == 5.0).all()) and placed.splits_by_layer
    for elsewhere, layers in ((context[:, :, :, 0:4], None), (span[1:], slice(0, 2)), (span.float(), None)):
        with pytest.raises(CodecError, match="elsewhere"):
            placed.decode_into(elsewhere, layers)
    with pytest.raises(CodecError, match="elsewhere"):
        placed.decode_into()


def test_zstd_cuts_its_blocks_at_sections_in_one_standard_frame() -> None:
    gen = torch.Generator().manual_seed(7)
    uniform = torch.randint(0, 256, (100_000,), dtype=torch.uint8, generator=gen)  # as key pieces
    nibbles = (torch.randn(2, 200_000, generator=gen) * 3.5 + 8).round().clamp(0, 15).to(torch.uint8)
    skewed = nibbles[0] | nibbles[1] << 4  # as 4-bit value codes, a few percent compressible
    raw = memoryview(torch.cat([uniform, skewed]).numpy().tobytes())
    cut = compress_sections(raw, "zstd", 3, [0, len(uniform)])
    assert len(cut) < len(compress(raw, "zstd", 3))  # fixed-size blocks mix the sections
    assert zstandard.ZstdDecompressor().decompress(cut) == bytes(raw)  # any zstd reader, one frame
    assert bytes(decompress(memoryview(cut), "zstd", len(raw))) == bytes(raw)
    small = memoryview(bytes(range(200)) * 4)  # sections under MIN_SECTION_BLOCK are not cut apart
    assert compress_sections(small, "zstd", 3, [0, 100, 300]) == compress(small, "zstd", 3)
    assert compress_sections(raw, "lz4", 0, [0, len(raw) // 2]) == compress(raw, "lz4", 0)

