"""Native dequantization where the CPU and the tensors allow it (cachestore/_kernels.c); else the caller uses torch.

A hit's int8 and int4 KV is converted, scaled (and offset) in one pass straight into its context, on the calling
thread. torch reaches fp16 (llama.cpp's sequence state) only through an fp32 temporary, about three times the
kernel's time. int4 takes torch five passes (widen, shift, mask, convert, scale and offset): the kernel's one,
on one thread, is faster than those on two. int8 into fp32
is torch's two passes, on all its threads, as fast as the kernel on one: there the kernel runs only where torch
has one thread. Threads of the kernel's own lost to torch's spinning OpenMP workers in a real forward step.
Into fp16 token rows (a llama.cpp sequence state: each token's heads side by side), int8 is staged in L1 and
streamed to memory past the cache, so the lines of the tens of MB a hit writes are not first read in (`token_rows`).
The values are bit-identical to torch's (tests/test_kernels.py). The attention passes (`attention_scores`,
`attention_values`) read a landed hit's codes in place for the first forward step (cachestore.codec.attend),
dequantizing each element in a register; their sums are fp32 in another order than torch's (tests/test_attend.py).
KVSTASH_NATIVE_KERNELS=0 turns the kernels off (`cachestore.settings.native_kernels`, read on first use or by
`configure`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import torch

from cachestore import settings

_kernels: ModuleType | None
try:
    import cachestore._kernels as _kernels
except ImportError:  # built without its compiler, or not built: torch does the work
    _kernels = None

LEVEL = _kernels.level if _kernels is not None else 0  # 2: AVX-512F, 1: AVX2 + F16C, 0: none
_STAGE_ELEMENTS = _kernels.stage_elements if _kernels is not None else 0  # the longest token row it streams
ENABLED = bool(LEVEL)  # a CPU and build with a kernel, at the level in use (`use_level`)
_wanted: bool | None = None  # the setting; None until it is read, on first use or by configure()
_OUT = (torch.float32, torch.float16)


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Apply KVSTASH_NATIVE_KERNELS strictly (`settings.native_kernels`: anything but 0 or 1 is a ConfigError) and
    return whether the kernels are used. The command line calls it before a command that runs a model."""
    global _wanted
    _wanted = settings.native_kernels(environ)
    return enabled()


def _want() -> bool:
    """The setting, read (leniently) the first time a kernel is asked for, unless configure() read it first."""
    global _wanted
    if _wanted is None:
        _wanted = settings.native_kernels(strict=False)
    return _wanted


def enabled() -> bool:
    """Whether the kernels run: a CPU and build with a kernel, and the setting."""
    return ENABLED and _want()


def int8_into(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> bool:
    """out [A, B, T, D] or [L, A, B, T, D] (fp32 or fp16, any outer strides, rows contiguous) = int8 codes of that
    shape times fp16 scales broadcast to it (one per row or one per column), in one pass; False (nothing written) where
    no kernel applies: then the caller uses torch. Five dimensions only into token rows (`token_rows` of each out[l]):
    a run of frames, every layer of every frame in one call."""
    if not enabled() or out.dtype not in _OUT or codes.dtype != torch.int8 or scale.dtype != torch.float16:
        return False
    if out.dtype == torch.float32 and torch.get_num_threads() > 1:
        return False  # torch's two passes on all its threads are as fast
    if out.dim() not in (4, 5) or codes.shape != out.shape or out.shape[-1] % 16 or out.device.type != "cpu":
        return False
    if out.stride(-1) != 1 or codes.stride(-1) != 1 or codes.device.type != "cpu" or scale.device.type != "cpu":
        return False
    try:
        scales = scale.expand(out.shape)
    except RuntimeError:
        return False
    if scales.stride(-1) not in (0, 1):
        return False
    assert _kernels is not None
    if out.dim() == 5 or token_rows(out):  # a llama.cpp state's rows: streamed past the cache, the same values
        outer, q, sc = (out, codes, scales) if out.dim() == 5 else (t.unsqueeze(0) for t in (out, codes, scales))
        if not token_rows(outer[0]):
            return False
        _kernels.int8_rows(outer.data_ptr(), (outer.stride(0), outer.stride(1)), q.data_ptr(), sc.data_ptr(),
                           tuple(outer.shape), q.stride()[:4], sc.stride())
        return True
    a, b, t, d = out.shape
    _kernels.int8(out.data_ptr(), out.dtype == torch.float16, codes.data_ptr(), scales.data_ptr(), (a, b, t, d),
                  out.stride()[:3], codes.stride()[:3], scales.stride())
    return True


def token_rows(out: torch.Tensor) -> bool:
    """Whether fp16 `out` [A, B, T, D] holds, for each a, its tokens one after another, each token's B rows of D side
    by side (llama.cpp's sequence state: a layer's K or V, a token's heads together), as many as the kernel stages
    at once (`stage_elements`). Those are tens of MB that nothing reads before llama.cpp copies them:
    the kernel streams them to memory without reading each line in first (a 2048-token SmolLM2 hit's 47 MB with the
    caches cold: 5.4 against 8.1 ms)."""
    _, b, t, d = out.shape
    return (out.dtype == torch.float16 and b * d <= _STAGE_ELEMENTS and (b == 1 or out.stride(1) == d)
            and (t == 1 or out.stride(2) == b * d))


def transposed_into(out: torch.Tensor, src: torch.Tensor) -> bool:
    """out [K, C, R] = src [K, R, C] transposed (out[k][c][r] = src[k][r][c]), both of one 2-byte dtype with rows
    contiguous, the bits moved as they are; False (nothing written) where the kernel does not apply: then the caller
    copies. llama.cpp's state without flash attention stores each layer's V this way: a 2048-token SmolLM2 V in 5 ms
    against 14-16 for numpy's strided copy. Plain C and SSE2: at any kernel level."""
    if _kernels is None or not _want() or out.dtype != src.dtype or out.element_size() != 2 or out.dim() != 3:
        return False
    k, c, r = out.shape
    if tuple(src.shape) != (k, r, c) or out.device.type != "cpu" or src.device.type != "cpu":
        return False
    if (out.stride(2) != 1 and r > 1) or (src.stride(2) != 1 and c > 1) or out.stride(1) < r or src.stride(1) < c:
        return False
    _kernels.transpose16(out.data_ptr(), src.data_ptr(), (k, r, c), (out.stride(0), out.stride(1)),
                         (src.stride(0), src.stride(1)))
    return True


def int4_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> bool:
    """out [A, B, C, E, F] (fp32 or fp16, any outer strides, rows contiguous) = the int4 codes of `packed` (uint8,
    contiguous, two codes a byte, low nibble first, in out's C order) times fp16 `scale` plus fp16 `zero`, both
    broadcast to out's shape alike. False (nothing written) where no kernel applies."""
    if not enabled() or out.dtype not in _OUT or packed.dtype != torch.uint8 or not packed.is_contiguous():
        return False
    if scale.dtype != torch.float16 or zero.dtype != torch.float16 or out.dim() != 5 or out.shape[4] % 16:
        return False
    if out.stride(4) != 1 or 2 * packed.numel() < out.numel() or out.device.type != "cpu":
        return False
    try:
        scales, zeros = scale.expand(out.shape), zero.expand(out.shape)
    except RuntimeError:
        return False
    if scales.stride() != zeros.stride() or scales.stride(4) not in (0, 1) or packed.device.type != "cpu":
        return False
    assert _kernels is not None
    a, b, c, e, f = out.shape
    _kernels.int4(out.data_ptr(), out.dtype == torch.float16, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(),
                  (a, b, c, e, f), out.stride()[:4], (b * c * e * f, c * e * f, e * f, f), scales.stride())
    return True


def attention_scores(out: torch.Tensor, queries: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None,
                     zero: torch.Tensor | None = None, group: int = 1) -> bool:
    """out [H, M, A, T] (fp32, rows contiguous) = queries [H, M, D] (fp32) dotted with one layer of A frames' keys,
    read where they lie in one pass (cachestore.codec.attend): fp16 or fp32 [A, H, T, D]; int8 codes [A, H, T, D] times
    fp16 `scale` [A, H, 1, D]; or int4 codes, uint8 [A, H * ceil(T / group) * group * D / 2] (two a byte, low nibble
    first, [H, rows, D] order, the last group's rows padded), times fp16 `scale` plus fp16 `zero`, both [A, H,
    ceil(T / group), D] (one per column, a scale for `group` rows). False (nothing written) where no kernel
    applies."""
    if out.dim() != 4 or queries.dim() != 3 or tuple(out.shape[:2]) != tuple(queries.shape[:2]):
        return False
    a, t = out.shape[2], out.shape[3]
    h, _, d = queries.shape
    rows = max(group, 1) if codes.dtype == torch.uint8 else t
    groups = -(-t // rows)
    if scale is not None and (tuple(scale.shape) != (a, h, groups, d) or scale.stride(3) != 1):
        return False
    return _attend(out, queries, codes, scale, zero, rows, groups * rows, False)


def attention_values(out: torch.Tensor, weights: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None = None,
                     zero: torch.Tensor | None = None, group: int = 0) -> bool:
    """out [H, M, D] (fp32, rows contiguous) += the sum over a and t of weights [H, M, A, T] (fp32) times one layer
    of A frames' values, read where they lie in one pass (cachestore.codec.attend): fp16 or fp32 [A, H, T, D]; int8
    codes [A, H, T, D] times fp16 `scale` [A, H, T, 1]; or int4 codes, uint8 [A, H * T * D / 2] (two a byte, low nibble
    first, [H, T, D] order), times fp16 `scale` plus fp16 `zero`, both [A, H, T, D / group] (one per row, a scale
    for `group` columns, a multiple of 16). False (nothing written) where no kernel applies."""
    if out.dim() != 3 or weights.dim() != 4 or tuple(out.shape[:2]) != tuple(weights.shape[:2]):
        return False
    a, t = weights.shape[2], weights.shape[3]
    h, _, d = out.shape
    columns = max(group, 1) if codes.dtype == torch.uint8 else d
    if d % columns or (scale is not None and (tuple(scale.shape) != (a, h, t, d // columns)
                                              or (d // columns > 1 and scale.stride(3) != 1))):
        return False
    return _attend(out, weights, codes, scale, zero, columns, t, True)


_BITS = {torch.int8: 8, torch.uint8: 4, torch.float16: 16, torch.float32: 32}


def _attend(out: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor | None,
            zero: torch.Tensor | None, group: int, head_rows: int, values: bool) -> bool:
    """The checks the attention kernels share, then the call: `out` and `rows` are the scores and the queries, or
    the output and the weights (`values`); fp16, fp32 or int8 codes [A, H, T, D] (int8 with a scale), or int4 ones
    packed [A, H * head_rows * D / 2] (a head's T rows, then padding to `head_rows`; with a scale and an offset); D a
    multiple of 16 up to 256."""
    scores, queries = (rows, out) if values else (out, rows)
    h, m, d = queries.shape
    a, t = scores.shape[2], scores.shape[3]
    bits = _BITS.get(codes.dtype)
    if not enabled() or bits is None or out.dtype != torch.float32 or rows.dtype != torch.float32:
        return False
    if d % 16 or not 0 < d <= 256 or queries.stride(2) != 1 or scores.stride(3) != 1:
        return False
    if (scale is None) != (bits > 8) or (zero is None) != (bits != 4):
        return False
    strides: tuple[int, ...]
    if bits == 4:
        if tuple(codes.shape) != (a, h * head_rows * d // 2) or codes.stride(1) != 1 or head_rows < t:
            return False
        strides = (2 * codes.stride(0), head_rows * d, d)
    elif tuple(codes.shape) != (a, h, t, d) or codes.stride(3) != 1:
        return False
    else:
        strides = codes.stride()[:3]
    scaled = [x for x in (scale, zero) if x is not None]
    if any(x.dtype != torch.float16 or x.stride() != scaled[0].stride() or x.shape != scaled[0].shape
           for x in scaled):
        return False
    if any(x.device.type != "cpu" for x in (out, rows, codes, *scaled)):
        return False
    assert _kernels is not None
    s = scaled[0] if scaled else codes
    z = scaled[-1] if scaled else codes
    _kernels.attend(out.data_ptr(), rows.data_ptr(), codes.data_ptr(), s.data_ptr(), z.data_ptr(), bits, values,
                    (a, h, t, d, m, group), strides, s.stride()[:3] if scaled else (0, 0, 0), queries.stride()[:2],
                    scores.stride()[:3])
    return True


def use_level(level: int) -> int:
    """Run the kernel's code path `level` (at most the CPU's; 0: none, torch does the work) and return the level in
    use: tests cover the AVX2 path on AVX-512 CPUs with it."""
    global ENABLED
    if _kernels is None:
        return 0
    used = int(_kernels.use(level))
    ENABLED = bool(used)
    return used
