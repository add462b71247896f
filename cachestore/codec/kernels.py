"""Native dequantization where the CPU and the arrays allow it (cachestore/_kernels.c); else the caller uses its
library (numpy, or torch for tensors: `cachestore.codec.arrays`).

A hit's int8 and int4 KV is converted, scaled (and offset) in one pass straight into its context, on the calling
thread. torch reaches fp16 (llama.cpp's sequence state) only through an fp32 temporary, about three times the
kernel's time. int4 takes torch five passes (widen, shift, mask, convert, scale and offset): the kernel's one,
on one thread, is faster than those on two. int8 into fp32 is torch's two passes, on all its threads, as fast as
the kernel on one: there the kernel runs only where torch has one thread (numpy's passes have one: numpy arrays
always take the kernel). Threads of the kernel's own lost to torch's spinning OpenMP workers in a real forward step.
Into fp16 token rows (a llama.cpp sequence state: each token's heads side by side), int8 is staged in L1 and
streamed to memory past the cache, so the lines of the tens of MB a hit writes are not first read in (`token_rows`).
The values are bit-identical to torch's (tests/cachestore/codec/test_kernels.py). The attention passes
(`attention_scores`, `attention_values`) read a landed hit's codes in place for the first forward step
(cachestore.codec.attend), dequantizing each element in a register; their sums are fp32 in another order than
torch's (tests/cachestore/codec/test_attend.py).
KVSTASH_NATIVE_KERNELS=0 turns the kernels off (`cachestore.settings.native_kernels`, read on first use or by
`configure`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from cachestore import settings
from cachestore.codec.arrays import Array, dtype_name, is_torch, namespace, numel, on_cpu, ptr, strides, torch

_kernels: ModuleType | None
try:
    import cachestore._kernels as _kernels
except ImportError:  # built without its compiler, or not built: numpy or torch does the work
    _kernels = None

LEVEL = _kernels.level if _kernels is not None else 0  # 2: AVX-512F, 1: AVX2 + F16C, 0: none
_STAGE_ELEMENTS = _kernels.stage_elements if _kernels is not None else 0  # the longest token row it streams
ENABLED = bool(LEVEL)  # a CPU and build with a kernel, at the level in use (`use_level`)
_wanted: bool | None = None  # the setting; None until it is read, on first use or by configure()
_OUT = ("float32", "float16")


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


def _broadcast(x: Array, shape: tuple[int, ...]) -> Array | None:
    """x broadcast to `shape` (a view), or None where it does not broadcast."""
    try:
        return namespace(x).broadcast_to(x, shape)
    except (RuntimeError, ValueError):
        return None


def _torch_threads() -> int:
    """torch's intra-op threads (only asked where a tensor came, so torch is imported already)."""
    return int(torch().get_num_threads())


def int8_into(out: Array, codes: Array, scale: Array) -> bool:
    """out [A, B, T, D] or [L, A, B, T, D] (fp32 or fp16, any outer strides, rows contiguous) = int8 codes of that
    shape times fp16 scales broadcast to it (one per row or one per column), in one pass; False (nothing written) where
    no kernel applies: then the caller uses its library. Five dimensions only into token rows (`token_rows` of each
    out[l]): a run of frames, every layer of every frame in one call."""
    if not enabled() or dtype_name(out) not in _OUT or dtype_name(codes) != "int8" or dtype_name(scale) != "float16":
        return False
    if dtype_name(out) == "float32" and is_torch(out) and _torch_threads() > 1:
        return False  # torch's two passes on all its threads are as fast
    if out.ndim not in (4, 5) or tuple(codes.shape) != tuple(out.shape) or out.shape[-1] % 16 or not on_cpu(out):
        return False
    if strides(out)[-1] != 1 or strides(codes)[-1] != 1 or not on_cpu(codes) or not on_cpu(scale):
        return False
    if is_torch(out) != is_torch(codes) or is_torch(out) != is_torch(scale):
        return False
    scales = _broadcast(scale, tuple(out.shape))
    if scales is None or strides(scales)[-1] not in (0, 1):
        return False
    assert _kernels is not None
    if out.ndim == 5 or token_rows(out):  # a llama.cpp state's rows: streamed past the cache, the same values
        outer, q, sc = (out, codes, scales) if out.ndim == 5 else (t[None] for t in (out, codes, scales))
        if not token_rows(outer[0]):
            return False
        so = strides(outer)
        _kernels.int8_rows(ptr(outer), (so[0], so[1]), ptr(q), ptr(sc), tuple(outer.shape), strides(q)[:4],
                           strides(sc))
        return True
    a, b, t, d = out.shape
    _kernels.int8(ptr(out), dtype_name(out) == "float16", ptr(codes), ptr(scales), (a, b, t, d), strides(out)[:3],
                  strides(codes)[:3], strides(scales))
    return True


def token_rows(out: Array) -> bool:
    """Whether fp16 `out` [A, B, T, D] holds, for each a, its tokens one after another, each token's B rows of D side
    by side (llama.cpp's sequence state: a layer's K or V, a token's heads together), as many as the kernel stages
    at once (`stage_elements`). Those are tens of MB that nothing reads before llama.cpp copies them:
    the kernel streams them to memory without reading each line in first (a 2048-token SmolLM2 hit's 47 MB with the
    caches cold: 5.4 against 8.1 ms)."""
    _, b, t, d = out.shape
    s = strides(out)
    return (dtype_name(out) == "float16" and b * d <= _STAGE_ELEMENTS and (b == 1 or s[1] == d)
            and (t == 1 or s[2] == b * d))


def transposed_into(out: Array, src: Array) -> bool:
    """out [K, C, R] = src [K, R, C] transposed (out[k][c][r] = src[k][r][c]), both of one 2-byte dtype with rows
    contiguous, the bits moved as they are; False (nothing written) where the kernel does not apply: then the caller
    copies. llama.cpp's state without flash attention stores each layer's V this way: a 2048-token SmolLM2 V in 5 ms
    against 14-16 for numpy's strided copy. Plain C and SSE2: at any kernel level."""
    if _kernels is None or not _want() or dtype_name(out) != dtype_name(src) or out.ndim != 3:
        return False
    if dtype_name(out) not in ("float16", "bfloat16", "int16", "uint16"):
        return False
    k, c, r = out.shape
    if tuple(src.shape) != (k, r, c) or not on_cpu(out) or not on_cpu(src):
        return False
    so, ss = strides(out), strides(src)
    if (so[2] != 1 and r > 1) or (ss[2] != 1 and c > 1) or so[1] < r or ss[1] < c:
        return False
    _kernels.transpose16(ptr(out), ptr(src), (k, r, c), (so[0], so[1]), (ss[0], ss[1]))
    return True


def hadamard_rows(x: Array, scale: float) -> bool:
    """x [rows, size] (fp32, C-contiguous, on the cpu; size a power of two) in place = each row's fast Walsh-Hadamard
    transform times `scale` (cachestore.codec.rotation), the same bits as the library's rounds; False (nothing
    written) where the kernel does not apply. Plain C: at any kernel level."""
    if _kernels is None or not _want() or dtype_name(x) != "float32" or x.ndim != 2 or not on_cpu(x) or not _dense(x):
        return False
    if not hasattr(_kernels, "hadamard"):  # a module built before it had the pass: the library's rounds, same bits
        return False
    rows, size = x.shape
    if size & (size - 1) or size > 4096:
        return False
    _kernels.hadamard(ptr(x), (rows, size), scale)
    return True


def int4_into(out: Array, packed: Array, scale: Array, zero: Array) -> bool:
    """out [A, B, C, E, F] (fp32 or fp16, any outer strides, rows contiguous) = the int4 codes of `packed` (uint8,
    contiguous, two codes a byte, low nibble first, in out's C order) times fp16 `scale` plus fp16 `zero`, both
    broadcast to out's shape alike. False (nothing written) where no kernel applies."""
    if not enabled() or dtype_name(out) not in _OUT or dtype_name(packed) != "uint8" or not _dense(packed):
        return False
    if dtype_name(scale) != "float16" or dtype_name(zero) != "float16" or out.ndim != 5 or out.shape[4] % 16:
        return False
    if strides(out)[4] != 1 or 2 * numel(packed) < numel(out) or not on_cpu(out) or not on_cpu(packed):
        return False
    if len({is_torch(x) for x in (out, packed, scale, zero)}) != 1:
        return False
    scales, zeros = _broadcast(scale, tuple(out.shape)), _broadcast(zero, tuple(out.shape))
    if scales is None or zeros is None or strides(scales) != strides(zeros) or strides(scales)[4] not in (0, 1):
        return False
    assert _kernels is not None
    a, b, c, e, f = out.shape
    _kernels.int4(ptr(out), dtype_name(out) == "float16", ptr(packed), ptr(scales), ptr(zeros), (a, b, c, e, f),
                  strides(out)[:4], (b * c * e * f, c * e * f, e * f, f), strides(scales))
    return True


def _dense(x: Array) -> bool:
    """Whether x is C-contiguous."""
    expected = 1
    for size, step in zip(reversed(x.shape), reversed(strides(x)), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def attention_scores(out: Array, queries: Array, codes: Array, scale: Array | None = None,
                     zero: Array | None = None, group: int = 1) -> bool:
    """out [H, M, A, T] (fp32, rows contiguous) = queries [H, M, D] (fp32) dotted with one layer of A frames' keys,
    read where they lie in one pass (cachestore.codec.attend): fp16 or fp32 [A, H, T, D]; int8 codes [A, H, T, D] times
    fp16 `scale` [A, H, 1, D]; or int4 codes, uint8 [A, H * ceil(T / group) * group * D / 2] (two a byte, low nibble
    first, [H, rows, D] order, the last group's rows padded), times fp16 `scale` plus fp16 `zero`, both [A, H,
    ceil(T / group), D] (one per column, a scale for `group` rows). False (nothing written) where no kernel
    applies."""
    if out.ndim != 4 or queries.ndim != 3 or tuple(out.shape[:2]) != tuple(queries.shape[:2]):
        return False
    a, t = out.shape[2], out.shape[3]
    h, _, d = queries.shape
    rows = max(group, 1) if dtype_name(codes) == "uint8" else t
    groups = -(-t // rows)
    if scale is not None and (tuple(scale.shape) != (a, h, groups, d) or strides(scale)[3] != 1):
        return False
    return _attend(out, queries, codes, scale, zero, rows, groups * rows, False)


def attention_values(out: Array, weights: Array, codes: Array, scale: Array | None = None,
                     zero: Array | None = None, group: int = 0) -> bool:
    """out [H, M, D] (fp32, rows contiguous) += the sum over a and t of weights [H, M, A, T] (fp32) times one layer
    of A frames' values, read where they lie in one pass (cachestore.codec.attend): fp16 or fp32 [A, H, T, D]; int8
    codes [A, H, T, D] times fp16 `scale` [A, H, T, 1]; or int4 codes, uint8 [A, H * T * D / 2] (two a byte, low nibble
    first, [H, T, D] order), times fp16 `scale` plus fp16 `zero`, both [A, H, T, D / group] (one per row, a scale
    for `group` columns, a multiple of 16). False (nothing written) where no kernel applies."""
    if out.ndim != 3 or weights.ndim != 4 or tuple(out.shape[:2]) != tuple(weights.shape[:2]):
        return False
    a, t = weights.shape[2], weights.shape[3]
    h, _, d = out.shape
    columns = max(group, 1) if dtype_name(codes) == "uint8" else d
    if d % columns or (scale is not None and (tuple(scale.shape) != (a, h, t, d // columns)
                                              or (d // columns > 1 and strides(scale)[3] != 1))):
        return False
    return _attend(out, weights, codes, scale, zero, columns, t, True)


_BITS = {"int8": 8, "uint8": 4, "float16": 16, "float32": 32}


def _attend(out: Array, rows: Array, codes: Array, scale: Array | None,
            zero: Array | None, group: int, head_rows: int, values: bool) -> bool:
    """The checks the attention kernels share, then the call: `out` and `rows` are the scores and the queries, or
    the output and the weights (`values`); fp16, fp32 or int8 codes [A, H, T, D] (int8 with a scale), or int4 ones
    packed [A, H * head_rows * D / 2] (a head's T rows, then padding to `head_rows`; with a scale and an offset); D a
    multiple of 16 up to 256."""
    scores, queries = (rows, out) if values else (out, rows)
    h, m, d = queries.shape
    a, t = scores.shape[2], scores.shape[3]
    bits = _BITS.get(dtype_name(codes))
    if not enabled() or bits is None or dtype_name(out) != "float32" or dtype_name(rows) != "float32":
        return False
    if d % 16 or not 0 < d <= 256 or strides(queries)[2] != 1 or strides(scores)[3] != 1:
        return False
    if (scale is None) != (bits > 8) or (zero is None) != (bits != 4):
        return False
    cs = strides(codes)
    steps: tuple[int, ...]
    if bits == 4:
        if tuple(codes.shape) != (a, h * head_rows * d // 2) or cs[1] != 1 or head_rows < t:
            return False
        steps = (2 * cs[0], head_rows * d, d)
    elif tuple(codes.shape) != (a, h, t, d) or cs[3] != 1:
        return False
    else:
        steps = cs[:3]
    scaled = [x for x in (scale, zero) if x is not None]
    if any(dtype_name(x) != "float16" or strides(x) != strides(scaled[0]) or tuple(x.shape) != tuple(scaled[0].shape)
           for x in scaled):
        return False
    if any(not on_cpu(x) for x in (out, rows, codes, *scaled)) or len({is_torch(x) for x in (out, rows, codes,
                                                                                             *scaled)}) != 1:
        return False
    assert _kernels is not None
    s = scaled[0] if scaled else codes
    z = scaled[-1] if scaled else codes
    _kernels.attend(ptr(out), ptr(rows), ptr(codes), ptr(s), ptr(z), bits, values,
                    (a, h, t, d, m, group), steps, strides(s)[:3] if scaled else (0, 0, 0), strides(queries)[:2],
                    strides(scores)[:3])
    return True


def use_level(level: int) -> int:
    """Run the kernel's code path `level` (at most the CPU's; 0: none, numpy or torch does the work) and return the
    level in use: tests cover the AVX2 path on AVX-512 CPUs with it."""
    global ENABLED
    if _kernels is None:
        return 0
    used = int(_kernels.use(level))
    ENABLED = bool(used)
    return used
