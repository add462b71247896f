"""The native int8 kernel (cachestore/_kernels.c) writes exactly what torch writes, wherever it is used."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cachestore.codec import Codec, kernels
from cachestore.codec.rotation import rotate
from cachestore.errors import ConfigError


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


needs_kernel = pytest.mark.skipif(not kernels.enabled(), reason="no native kernel on this CPU or build")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The kernel writes fp32 only where torch runs on one thread (as in a llama.cpp pod)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_kernel_is_built_where_the_cpu_has_it() -> None:
    """`make setup` compiles it: an x86-64 machine with AVX2 and F16C (every CI machine here) must have it, or the
    build silently fell back to torch."""
    flags = _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "f16c"} <= flags:
        pytest.skip("not an x86-64 CPU with AVX2 and F16C")
    assert kernels.LEVEL == (2 if "avx512f" in flags else 1)


def _torch_reference(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    ref = torch.empty_like(out)
    if out.dtype == torch.float16:
        ref.copy_(q.float().mul_(scale.float()))
    else:
        ref.copy_(q).mul_(scale.float())
    return ref


def _scales(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp16 scales over their whole range: subnormal, tiny, ordinary, large enough to overflow fp16 products."""
    pick = torch.randint(0, 4, shape, generator=gen)
    magnitude = torch.tensor([6e-8, 1e-4, 0.02, 600.0])[pick]
    return (magnitude * (0.5 + torch.rand(shape, generator=gen))).half()


@pytest.mark.usefixtures("one_thread", "level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per", ["row", "column"])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_int8_into_strided_views_is_bit_identical_to_torch(dtype: torch.dtype, per: str, dim: int) -> None:
    """Codes read at a frame's stride out of a larger buffer, written into a permuted view of a larger context
    (as FrameRun and llama.cpp's state view do); scales per token (values) or per channel (keys)."""
    gen = torch.Generator().manual_seed(dim)
    n, heads, tokens = 3, 2, 5
    buffer = torch.randint(-127, 128, (n * 4000,), dtype=torch.int8, generator=gen)
    q = buffer.as_strided((n, heads, tokens, dim), (4000, tokens * dim, dim, 1), 64)
    scale = _scales((n, heads, tokens, 1) if per == "row" else (n, heads, 1, dim), gen)
    context = torch.full((heads, n * tokens + 4, dim), float("nan"), dtype=dtype)
    out = context[:, :n * tokens].view(heads, n, tokens, dim).permute(1, 0, 2, 3)
    want = _torch_reference(out, q, scale)
    assert kernels.int8_into(out, q, scale)
    assert out.view(torch.int16 if dtype == torch.float16 else torch.int32).equal(
        want.view(torch.int16 if dtype == torch.float16 else torch.int32))  # bit for bit, infinities included
    assert torch.isnan(context[:, n * tokens:]).all()  # nothing written past the view


@pytest.mark.usefixtures("one_thread", "level")
@pytest.mark.parametrize(("heads", "dim", "tokens"), [(1, 16, 7), (3, 64, 64), (2, 128, 5), (4, 64, 130), (1, 8208, 2)])
@pytest.mark.parametrize("per", ["row", "column"])
def test_int8_intotoken_rows_is_bit_identical_to_torch(heads: int, dim: int, tokens: int, per: str) -> None:
    """llama.cpp's sequence state: for each layer, its tokens one after another, each token's heads side by side,
    every layer at another byte offset (a 12-byte header before each). The kernel streams those rows past the cache
    (`token_rows`; a token row longer than its staging buffer takes the ordinary path) and writes exactly torch's
    values, and nothing around them."""
    gen = torch.Generator().manual_seed(heads * dim + tokens)
    layers, row = 3, heads * dim
    layer = row * tokens + 6  # fp16 elements from one layer's first row to the next's: 12 bytes more
    buffer = torch.full((7 + layers * layer + 5,), float("nan"), dtype=torch.float16)
    shape, strides = (layers, heads, tokens, dim), (layer, dim, row, 1)
    out = buffer.as_strided(shape, strides, 7)
    assert kernels.token_rows(out) == (row <= 8192)
    codes = torch.randint(-127, 128, (layers * (heads * tokens * dim + 32),), dtype=torch.int8, generator=gen)
    q = codes.as_strided(shape, (heads * tokens * dim + 32, tokens * dim, dim, 1), 16)  # a frame's codes, apart
    scale = _scales((layers, heads, tokens, 1) if per == "row" else (layers, heads, 1, dim), gen)
    want = _torch_reference(out, q, scale)
    assert kernels.int8_into(out, q, scale)
    assert out.view(torch.int16).equal(want.view(torch.int16))  # bit for bit, infinities included
    inside = torch.zeros(buffer.shape, dtype=torch.bool)
    inside.as_strided(shape, strides, 7).fill_(True)
    assert torch.isnan(buffer[~inside]).all()  # the headers between layers and the ends are left as they were


@pytest.mark.usefixtures("one_thread", "level")
@pytest.mark.parametrize(("heads", "dim", "tokens", "frames"), [(3, 64, 64, 4), (1, 16, 7, 3), (4, 64, 5, 2)])
@pytest.mark.parametrize("per", ["row", "column"])
def test_int8_into_a_run_of_frames_writes_every_layer_of_each_in_one_call(heads: int, dim: int, tokens: int,
                                                                          frames: int, per: str) -> None:
    """A run of landed frames into llama.cpp's state (`FrameRun.decode_into`): out [layers, frames, heads, tokens,
    dim], each layer's frames one after another in its token rows (every layer at another byte offset), the codes
    and scales of frame k at a frame's stride in the landing. One call writes torch's values and nothing around."""
    gen = torch.Generator().manual_seed(heads * dim + tokens + frames)
    layers, row = 3, heads * dim
    layer = row * tokens * frames + 6  # fp16 elements from one layer's first row to the next's: 12 bytes more
    buffer = torch.full((7 + layers * layer + 5,), float("nan"), dtype=torch.float16)
    shape = (layers, frames, heads, tokens, dim)
    strides = (layer, tokens * row, dim, row, 1)
    out = buffer.as_strided(shape, strides, 7)
    frame = layers * heads * tokens * dim + 96  # a frame's codes, then room for its header and the next's
    landing = torch.randint(-127, 128, (frames * frame,), dtype=torch.int8, generator=gen)
    q = landing.as_strided(shape, (heads * tokens * dim, frame, tokens * dim, dim, 1), 32)
    scale = _scales((layers, frames, heads, tokens, 1) if per == "row" else (layers, frames, heads, 1, dim), gen)
    want = _torch_reference(out, q, scale)
    assert kernels.int8_into(out, q, scale)
    assert out.view(torch.int16).equal(want.view(torch.int16))
    inside = torch.zeros(buffer.shape, dtype=torch.bool)
    inside.as_strided(shape, strides, 7).fill_(True)
    assert torch.isnan(buffer[~inside]).all()


@needs_kernel
def test_what_the_kernel_does_not_take_is_left_to_torch(one_thread: None) -> None:
    q = torch.zeros((1, 1, 2, 24), dtype=torch.int8)
    out = torch.full((1, 1, 2, 24), 7.0)
    assert not kernels.int8_into(out, q, torch.ones((1, 1, 2, 1), dtype=torch.float16))  # rows of 24: not 16s
    q16, out16 = torch.zeros((1, 1, 2, 16), dtype=torch.int8), torch.full((1, 1, 2, 16), 7.0)
    assert not kernels.int8_into(out16, q16, torch.ones((1, 1, 2, 1)))  # fp32 scales
    assert not kernels.int8_into(out16.double(), q16, torch.ones((1, 1, 2, 1), dtype=torch.float16))
    ones = torch.ones((1, 1, 2, 1), dtype=torch.float16)
    assert not kernels.int8_into(torch.empty((1, 1, 2, 32))[..., ::2], q16, ones)  # rows not contiguous
    assert not kernels.int8_into(out16, q16, torch.ones((1, 1, 3, 1), dtype=torch.float16))  # not broadcastable
    assert (out == 7).all() and (out16 == 7).all()
    torch.set_num_threads(2)
    assert not kernels.int8_into(out16, q16, ones)  # int8 into fp32 where torch has two threads: torch's
    assert kernels.int8_into(out16.half(), q16, ones)  # fp16: the kernel's always


def _int4_reference(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """What torch writes: the codes converted, scaled and offset in fp32, then rounded to out's dtype."""
    ref = torch.empty_like(out)
    ref.copy_(codes.float().mul_(scale.float()).add_(zero.float()))
    return ref


@pytest.mark.usefixtures("one_thread", "level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("half", ["keys", "values"])
@pytest.mark.parametrize("width", [16, 64])
def test_int4_into_is_bit_identical_to_torch(dtype: torch.dtype, half: str, width: int) -> None:
    """Keys: [L, H, groups, group, D], a scale and offset per group and channel; values: [L, H, T, groups, group],
    one per token and group. Written into a permuted view of a larger context, as FrameRun does."""
    gen = torch.Generator().manual_seed(width)
    shape = (3, 2, 4, 2, width) if half == "keys" else (3, 2, 8, 2, width)
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=gen)
    packed = (codes.view(-1, 2)[:, 0] | (codes.view(-1, 2)[:, 1] << 4)).contiguous()
    per = (*shape[:3], 1, width) if half == "keys" else (*shape[:4], 1)
    scale, zero = _scales(per, gen), -_scales(per, gen)
    context = torch.full((shape[1], shape[0] * shape[2] + 3, *shape[3:]), float("nan"), dtype=dtype)
    out = context[:, :shape[0] * shape[2]].view(shape[1], shape[0], *shape[2:]).permute(1, 0, 2, 3, 4)
    want = _int4_reference(out, codes, scale, zero)
    assert kernels.int4_into(out, packed, scale, zero)
    bits = torch.int16 if dtype == torch.float16 else torch.int32
    assert out.contiguous().view(bits).equal(want.view(bits))
    assert torch.isnan(context[:, shape[0] * shape[2]:]).all()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["int4", "int4/g32", "int4/rotv", "int4/g16", "int4/symv/s8/k5=0.2/v5=1",
                                  "int4+zstd/kbits/s8/v5=1"])
def test_int4_frames_decode_the_same_with_and_without_the_kernel(dtype: torch.dtype, spec: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the codec (rotated halves, padded groups, int2 and split layouts stay torch's): the kernel changes no
    value."""
    kv = torch.randn(3, 2, 2, 48, 64, generator=torch.Generator().manual_seed(5)) * 3
    frame = Codec(spec).encode(kv)
    native = Codec(spec).decode_into(frame, torch.empty(kv.shape, dtype=dtype))
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert torch.equal(Codec(spec).decode_into(frame, torch.empty(kv.shape, dtype=dtype)), native)


def test_the_setting_is_read_on_first_use_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_wanted", None)  # as if no kernel had been asked for yet
    monkeypatch.setenv("KVSTASH_NATIVE_KERNELS", "0")
    assert not kernels.enabled()
    monkeypatch.setattr(kernels, "_wanted", None)
    monkeypatch.setenv("KVSTASH_NATIVE_KERNELS", "1")
    assert kernels.enabled() is bool(kernels.LEVEL)


def test_the_setting_is_0_or_1_and_anything_else_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_wanted", None)  # restored after the test
    assert kernels.configure({"KVSTASH_NATIVE_KERNELS": "0"}) is False and not kernels.enabled()
    assert kernels.configure({}) is bool(kernels.LEVEL) and kernels.enabled() is bool(kernels.LEVEL)
    assert kernels.configure({"KVSTASH_NATIVE_KERNELS": ""}) is bool(kernels.LEVEL)  # empty: unset, as elsewhere
    for bad in ("off", "2", "yes"):
        with pytest.raises(ConfigError, match="KVSTASH_NATIVE_KERNELS must be 0 .* or 1, got"):
            kernels.configure({"KVSTASH_NATIVE_KERNELS": bad})



built = pytest.mark.skipif(kernels._kernels is None, reason="the native module is not built")  # noqa: SLF001


@built
@pytest.mark.parametrize(("count", "rows", "cols"), [(3, 2048, 64), (2, 37, 64), (1, 64, 13), (4, 5, 3), (1, 8, 8),
                                                     (2, 0, 16)])
def test_transposed_into_moves_every_element_where_torch_would(count: int, rows: int, cols: int) -> None:
    """out[k][c][r] = src[k][r][c], bits as they are (NaN and infinity included), for 8 x 8 blocks and the rows and
    columns that no block covers; into and from strided views (a state's V, a context's [H, n, D]), nothing else
    written."""
    src_all = torch.randint(-32768, 32767, (count, rows + 3, cols + 5), dtype=torch.int16)
    src_all[..., 0] = 0x7E01  # a NaN's bits
    src = src_all[:, 1:rows + 1, 2:cols + 2].view(torch.float16)  # row stride cols + 5
    out_all = torch.full((count, cols + 2, rows + 7), 0x1234, dtype=torch.int16)
    out = out_all[:, 1:cols + 1, 3:rows + 3]  # row stride rows + 7
    assert kernels.transposed_into(out.view(torch.float16), src)
    assert torch.equal(out, src.view(torch.int16).transpose(1, 2))
    out_all[:, 1:cols + 1, 3:rows + 3] = 0x1234
    assert bool((out_all == 0x1234).all())  # nothing outside the view was written


@built
def test_transposed_into_declines_what_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another dtype or shape, rows not contiguous, or the kernels turned off: False and nothing written."""
    src = torch.randn(2, 16, 8).half()
    out = torch.zeros(2, 8, 16, dtype=torch.float16)
    assert not kernels.transposed_into(out.float(), src.float())  # 4-byte elements
    assert not kernels.transposed_into(out[:, :, :8], src)  # shapes that do not match
    assert not kernels.transposed_into(torch.zeros(2, 16, 8, dtype=torch.float16).transpose(1, 2), src)  # strided rows
    monkeypatch.setattr(kernels, "_wanted", False)  # KVSTASH_NATIVE_KERNELS=0
    assert not kernels.transposed_into(out, src)
    assert not out.any()


@built
@pytest.mark.parametrize("dim", [1, 4, 12, 64, 96, 128, 256])
def test_the_hadamard_pass_rounds_as_the_library_rounds(dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rotation of /rotv values in the kernel's one pass a row is bit for bit the library's rounds (numpy, torch
    on another device), and its own inverse to within rounding."""
    x = torch.randn(7, 3, 5, dim, generator=torch.Generator().manual_seed(dim)) * 4
    native = rotate(x)
    assert torch.allclose(rotate(native), x, atol=1e-5)
    monkeypatch.setattr(kernels, "_wanted", False)  # KVSTASH_NATIVE_KERNELS=0: the library's rounds
    assert torch.equal(rotate(x), native)
    assert rotate(x.numpy()).tobytes() == native.numpy().tobytes()
