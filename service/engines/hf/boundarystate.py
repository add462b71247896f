"""The hf engine's boundary state: its sliding layers' windows and linear layers' states at a position P, as bytes.

What a boundary record (cachestore.boundary) holds beside the full-attention KV, for the hf engine. Untrusted when
read back: `state_problem` checks every field against the model's layout (service.engines.hf.layout) and the
position before `unpack_state` allocates anything; no pickle, no torch.load. Little-endian throughout.

    offset  size  field
         0     4  magic      b"KVHS"
         4     1  version    1
         5     1  dtype      1 float32, 2 float16, 3 bfloat16 (every slot's)
         6     2  slots      u16: entries that follow
         8     4  position   u32 P: the tokens the state has seen
        12  24*n  entries    per slot: u16 layer, u8 kind (1 window, 2 conv, 3 recurrent), u8 index, u8 ndim,
                             3 reserved zero bytes, 4 x u32 dims (the first ndim used, the rest zero)
         .     .  payloads   each slot's tensor, C order, in entry order

A window's dims are [2, kv_heads, tokens, head_dim] (K then V; tokens = min(P, window - 1), what transformers'
DynamicSlidingWindowLayer keeps), a conv or recurrent state's its shape without the batch dimension.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import torch

from service.engines.hf.layout import WINDOW, HfLayout, StateSlot

MAGIC = b"KVHS"
VERSION = 1
DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_CODES = {code: dtype for dtype, code in DTYPES.items()}
_HEAD = struct.Struct("<4sBBHI")  # magic, version, dtype, slots, position
_ENTRY = struct.Struct("<HBBB3s4I")  # layer, kind, index, ndim, reserved, dims
MAX_DIMS = 4


class StateError(ValueError):
    """Bytes that are not a boundary state of this layout at this position."""


def expected_dims(slot: StateSlot, layout: HfLayout, position: int) -> tuple[int, ...]:
    """The dims `slot`'s tensor has in a state at `position`."""
    if slot.kind == WINDOW:
        heads, dim = slot.shape
        return (2, heads, layout.window_tokens(position), dim)
    return slot.shape


def pack_state(position: int, dtype: torch.dtype, parts: Sequence[tuple[StateSlot, torch.Tensor]]) -> bytes:
    """The bytes of a state at `position`: each slot's tensor (its dims as given) of `dtype`."""
    if dtype not in DTYPES or not 0 <= position < 1 << 32 or len(parts) >= 1 << 16:
        raise StateError(f"a state of {len(parts)} slots of {dtype} at {position}")
    entries, payloads = [], []
    for slot, tensor in parts:
        if tensor.dim() > MAX_DIMS or tensor.dtype != dtype:
            raise StateError(f"slot {slot.describe()}: a {tensor.dtype} tensor of {tensor.dim()} dims")
        dims = [int(d) for d in tensor.shape] + [0] * (MAX_DIMS - tensor.dim())
        entries.append(_ENTRY.pack(slot.layer, slot.kind, slot.index, tensor.dim(), bytes(3), *dims))
        payloads.append(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return _HEAD.pack(MAGIC, VERSION, DTYPES[dtype], len(parts), position) + b"".join(entries) + b"".join(payloads)


def state_problem(state: bytes | memoryview, layout: HfLayout, position: int, dtype: torch.dtype) -> str | None:
    """Why `state` (untrusted) is not the state `layout` keeps at `position` in `dtype`, or None: every header field,
    every slot's layer, kind, index and dims, and the total length, checked before anything is allocated."""
    if len(state) < _HEAD.size:
        return f"a state of {len(state)} bytes, shorter than its header"
    magic, version, code, count, at = _HEAD.unpack_from(state, 0)
    if magic != MAGIC or version != VERSION:
        return f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}"
    if _CODES.get(code) != dtype:
        return f"a state of dtype code {code}, this model keeps {dtype}"
    if at != position:
        return f"a state at position {at}, the record is at {position}"
    if count != len(layout.slots):
        return f"a state of {count} slots, this layout has {len(layout.slots)}"
    if len(state) < _HEAD.size + count * _ENTRY.size:
        return f"a state of {len(state)} bytes, shorter than its {count} entries"
    payload = 0
    element = torch.empty((), dtype=dtype).element_size()
    for i, slot in enumerate(layout.slots):
        layer, kind, index, ndim, reserved, *dims = _ENTRY.unpack_from(state, _HEAD.size + i * _ENTRY.size)
        want = expected_dims(slot, layout, position)
        if reserved != bytes(3) or ndim > MAX_DIMS or tuple(dims[:ndim]) != want or any(dims[ndim:]):
            return f"slot {i}: dims {tuple(dims[:min(ndim, MAX_DIMS)])}, expected {want}"
        if (layer, kind, index) != (slot.layer, slot.kind, slot.index):
            return f"slot {i}: layer {layer} kind {kind} index {index}, expected {slot.describe()}"
        payload += math.prod(want) * element
    if len(state) != _HEAD.size + count * _ENTRY.size + payload:
        return f"a state of {len(state)} bytes; its entries add up to {_HEAD.size + count * _ENTRY.size + payload}"
    return None


def unpack_state(state: bytes | memoryview, layout: HfLayout, position: int,
                 dtype: torch.dtype) -> list[torch.Tensor]:
    """Each slot's tensor of a state `state_problem` accepts (StateError otherwise), in the layout's slot order."""
    problem = state_problem(state, layout, position, dtype)
    if problem is not None:
        raise StateError(problem)
    view = memoryview(state).cast("B")
    at = _HEAD.size + len(layout.slots) * _ENTRY.size
    element = torch.empty((), dtype=dtype).element_size()
    out = []
    for slot in layout.slots:
        dims = expected_dims(slot, layout, position)
        size = math.prod(dims) * element
        raw = torch.frombuffer(bytearray(view[at:at + size]), dtype=torch.uint8) if size else \
            torch.empty(0, dtype=torch.uint8)
        out.append(raw.view(dtype).reshape(dims))
        at += size
    return out
