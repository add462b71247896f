"""The codec's arrays: numpy, or torch tensors where a caller passes them, through one source (the Array API).

Every quantizer and dequantizer takes its namespace from its input (`namespace`, array-api-compat's
`array_namespace`): numpy arrays are computed by numpy, torch tensors by torch on their own device (a GPU pod
quantizes there and moves the small codes over PCIe). torch is never imported here: only a tensor a caller passed
brings it in. What the Array API lacks is here: bit views and buffers on the host (`host_bytes`, `from_host`,
`as_strided`), element strides and addresses for the native kernels, in-place rounding, scatter, softmax, and the
dtypes of frames (bfloat16 in numpy is ml_dtypes').

Each helper computes the same bits in both libraries: elementwise IEEE arithmetic, exact reductions (min, max),
stable sorts, and sums in a fixed order (`fixed_sum`): a frame encoded from a torch tensor is byte-identical to
the one encoded from the same numpy array (tests/cachestore/codec/test_codec_torchfree.py).
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from types import ModuleType
from typing import Any

import array_api_compat
import array_api_compat.numpy as npx
import numpy as np

from cachestore.errors import CodecError

Array = Any  # a numpy array or a torch tensor (the Array API has no static type both satisfy)

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4,
            "int64": 8, "bool": 1}
FLOATS = ("float32", "float16", "bfloat16")


def namespace(*arrays: Array) -> Any:
    """The Array API namespace of `arrays` (array_api_compat's wrapper of numpy or torch)."""
    return array_api_compat.array_namespace(*arrays)


def is_torch(x: object) -> bool:
    """Whether x is a torch tensor (without importing torch: a tensor exists only where torch is imported)."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(x, module.Tensor)


def is_torch_ns(xp: Any) -> bool:
    return bool(array_api_compat.is_torch_namespace(xp))


def torch() -> ModuleType:
    """torch itself, imported on first need: only where a caller passed a tensor or named a torch device."""
    try:
        import torch as module  # noqa: PLC0415 - torch is optional: the codec needs numpy only
    except ImportError as exc:
        raise CodecError("a torch device was asked for, but torch is not installed") from exc
    return module


def torch_ns() -> Any:
    """array_api_compat's torch namespace (imports torch)."""
    torch()
    import array_api_compat.torch as tx  # noqa: PLC0415 - imports torch

    return tx


def target(device: object | None) -> tuple[Any, Any]:
    """(namespace, device) of decoded arrays: numpy for None, else torch on `device` (a torch.device or a name such
    as "cpu" or "cuda:0")."""
    if device is None:
        return npx, None
    t = torch()
    return torch_ns(), device if isinstance(device, t.device) else t.device(str(device))


def device_of(x: Array) -> Any:
    """x's torch device, or None for a numpy array."""
    return x.device if is_torch(x) else None


def on_cpu(x: Array) -> bool:
    return not is_torch(x) or x.device.type == "cpu"


@functools.cache
def _numpy_dtype(name: str) -> Any:
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415 - only bfloat16 KV in numpy needs it
        except ImportError as exc:
            raise CodecError("bfloat16 KV in numpy needs the ml_dtypes package") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype(xp: Any, name: str) -> Any:
    """The dtype called `name` ("float16", "bfloat16", "uint8", ...) in namespace xp."""
    if is_torch_ns(xp):
        return getattr(torch(), name)
    return _numpy_dtype(name)


@functools.cache
def _name(dt: Any) -> str:
    text = str(dt)
    return text[6:] if text.startswith("torch.") else np.dtype(dt).name


def is_torch_dtype(dt: Any) -> bool:
    """Whether `dt` is a torch dtype (a numpy dtype or type is not), without importing torch."""
    module = sys.modules.get("torch")
    return module is not None and isinstance(dt, module.dtype)


def empty(shape: tuple[int, ...], dt: Any) -> Array:
    """An uninitialized array of `shape` in the library `dt` belongs to: a numpy array for a numpy dtype, a torch
    tensor on the CPU for a torch dtype (an engine's KV comes in the library it computes with)."""
    if is_torch_dtype(dt):
        return torch().empty(shape, dtype=dt)
    return np.empty(shape, dtype=dt)


def empty_bytes(nbytes: int, like: Any) -> Array:
    """A 1-D uint8 buffer of `nbytes` in the library of dtype `like` (see `empty`)."""
    return empty((nbytes,), torch().uint8 if is_torch_dtype(like) else np.dtype(np.uint8))


def name_of(dt: Any) -> str:
    """The name of a numpy or torch dtype: "float32", "float16", "bfloat16", "int8", ..."""
    return _name(dt)


def dtype_name(x: Array) -> str:
    return _name(x.dtype)


def numel(x: Array) -> int:
    return math.prod(x.shape)


def strides(x: Array) -> tuple[int, ...]:
    """x's strides in elements (numpy counts bytes, torch elements)."""
    if is_torch(x):
        return tuple(x.stride())
    size = x.itemsize
    return tuple(s // size for s in x.strides)


def ptr(x: Array) -> int:
    """The address of x's first element."""
    return int(x.data_ptr()) if is_torch(x) else int(x.__array_interface__["data"][0])


def contiguous(x: Array) -> Array:
    return x.contiguous() if is_torch(x) else np.ascontiguousarray(x)


def copy(x: Array) -> Array:
    """A contiguous copy of x."""
    return x.clone(memory_format=torch().contiguous_format) if is_torch(x) else np.array(x, order="C")


def host_bytes(x: Array) -> np.ndarray:
    """x's bytes in C order as a flat numpy uint8 array on the host (a view where x is a contiguous cpu array)."""
    if is_torch(x):
        flat = x.contiguous().reshape(-1).view(torch().uint8)
        return flat.cpu().numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def from_host(x: np.ndarray, xp: Any, device: Any = None) -> Array:
    """A numpy array as namespace xp's array on `device`: itself for numpy, a tensor sharing its memory on the cpu
    (read-only memory is only ever read), a copy on another device."""
    if not is_torch_ns(xp):
        return x
    t = torch()
    name = x.dtype.name
    bits = x.view(np.int16) if name == "bfloat16" else x
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = t.from_numpy(bits)
    if name == "bfloat16":
        out = out.view(t.bfloat16)
    return out if device is None or t.device(device).type == "cpu" else out.to(device)


def to_host(x: Array) -> np.ndarray:
    """x as a numpy array (x itself, or a cpu tensor's memory, or a copy from another device)."""
    if not is_torch(x):
        return np.asarray(x)
    t = torch()
    x = x.detach().cpu()
    if x.dtype == t.bfloat16:
        return x.view(t.int16).numpy().view(_numpy_dtype("bfloat16"))
    return x.numpy()


def frombuffer(buf: Any) -> np.ndarray:
    """A flat uint8 numpy array over a (possibly read-only) buffer, without a copy."""
    return np.frombuffer(buf, dtype=np.uint8)


def as_strided(x: Array, shape: tuple[int, ...], steps: tuple[int, ...], offset: int) -> Array:
    """A view of flat x: `shape` with element strides `steps`, from element `offset`."""
    if is_torch(x):
        return x.as_strided(shape, steps, offset)
    size = x.itemsize
    return np.lib.stride_tricks.as_strided(x[offset:], shape, tuple(s * size for s in steps), writeable=False)


def axis_slice(x: Array, axis: int, start: int, stop: int) -> Array:
    """x[..., start:stop, ...] along `axis` (torch's narrow)."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def round_clip(x: Array, lo: float, hi: float) -> Array:
    """x rounded half to even and clipped to [lo, hi], in place (x is a temporary of the caller's)."""
    if is_torch(x):
        return x.round_().clamp_(lo, hi)
    np.rint(x, out=x)
    return np.clip(x, lo, hi, out=x)


def affine_into(out: Array, scale: Array, zero: Array) -> None:
    """out = out * scale + zero in place, out fp32 holding codes whose products with `scale` are exact (so a fused
    multiply-add and two roundings agree): torch's one pass, numpy's two."""
    if is_torch(out):
        torch().addcmul(zero, out, scale, out=out)
    else:
        np.multiply(out, scale, out=out)
        np.add(out, zero, out=out)


def fixed_sum(x: Array, axis: int) -> Array:
    """The sum along `axis` (kept, of size 1) in one fixed order, halves added pairwise: the same bits in numpy and
    torch on any device, where their own sums each add in an order of their own."""
    n = x.shape[axis]
    if n == 1:
        return x
    half = n // 2
    acc = axis_slice(x, axis, 0, half) + axis_slice(x, axis, half, 2 * half)  # the one new array; the rest in place
    if n % 2:
        acc = namespace(x).concat([acc, axis_slice(x, axis, 2 * half, n)], axis=axis)
    n = half + n % 2
    while n > 1:  # acc's first n along axis hold the partial sums: element i takes element i + half
        half = n // 2
        low = axis_slice(acc, axis, 0, half)
        low += axis_slice(acc, axis, half, 2 * half)
        if n % 2:  # the odd one out moves up beside the sums (its place, half, was read already)
            axis_slice(acc, axis, half, half + 1)[...] = axis_slice(acc, axis, 2 * half, n)
        n = half + n % 2
    return axis_slice(acc, axis, 0, 1)


def scatter(x: Array, axis: int, index: Array, values: Array) -> Array:
    """x with values[i] put at index[i] along `axis`, in place (torch's scatter_, numpy's put_along_axis); returns x."""
    if is_torch(x):
        return x.scatter_(axis, index, values)
    np.put_along_axis(x, index, values, axis)
    return x


def topk_indices(x: Array, k: int) -> Array:
    """The indices of the k largest along the last axis, in index order; ties taken lowest index first."""
    xp = namespace(x)
    return xp.sort(xp.argsort(x, axis=-1, descending=True, stable=True)[..., :k], axis=-1)


def softmax(x: Array, axis: int = -1) -> Array:
    if is_torch(x):
        return x.softmax(axis)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def reshape_view(x: Array, shape: tuple[int, ...]) -> Array:
    """x reshaped without a copy (writes reach x); ValueError (numpy) or RuntimeError (torch) where none can."""
    if is_torch(x):
        return x.view(shape)
    try:
        return np.reshape(x, shape, copy=False)
    except TypeError:  # numpy before 2.1: no copy argument
        view = x.view()
        try:
            view.shape = shape
        except AttributeError as exc:
            raise ValueError(str(exc)) from exc
        return view
