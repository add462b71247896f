"""Opened frames, and frames read where they landed: `OpenFrame` (verified and decompressed, dequantized a few
layers at a time), `PlacedFrame` (token rows verified where they were received) and `FrameRun` (frames of one kind at
one stride in a lookup's buffer, one layer of all of them dequantized in one call)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from cachestore.codec.arrays import (
    FLOATS,
    ITEMSIZE,
    Array,
    as_strided,
    device_of,
    dtype_name,
    from_host,
    is_torch,
    namespace,
    ptr,
    reshape_view,
    target,
)
from cachestore.codec.arrays import dtype as dtype_in
from cachestore.codec.dequant import dequantize, expand_split, int8_codes_into
from cachestore.codec.frame import FLOAT_MODES, SCALE8, SPLIT, V6, FrameHeader
from cachestore.codec.layout import Dims, Variant, codes_split_by_layer, split_layout
from cachestore.codec.plan import hi_of, kind_of, layer_slice, nbytes, plan, stored_shape, variant_of
from cachestore.errors import CodecError


@dataclass(frozen=True)
class OpenFrame:
    """A frame already verified and decompressed: dequantizing it cannot fail, and it can be done
    a few layers at a time (the pod hands layers to the forward step as they are ready)."""

    header: FrameHeader
    raw: Array  # the raw payload, uint8 on the host: a numpy array (a placed frame's holds none: any empty array)
    borrowed: bool = False  # `raw` is the caller's (read-only) frame bytes: never handed out as they are
    device: Any = None  # where `decode_into()` without an output decodes: None numpy, else a torch device

    @property
    def address(self) -> int:
        """The address of the raw payload's first byte."""
        return ptr(self.raw)

    @functools.cached_property
    def _sections(self) -> list[np.ndarray]:
        """The payload sections of quant.layout (layers first), numpy views of `raw`."""
        sections, offsets, _ = plan(self.header)
        parts = []
        for (sec_dtype, shape), start in zip(sections, offsets, strict=True):
            part = self.raw[start:start + nbytes(sec_dtype, shape)].view(dtype_in(np, sec_dtype))
            rows = self.header.rows and len(shape) == 5  # q8's one flat section is rows already
            parts.append(part.reshape(stored_shape(shape)).swapaxes(2, 3) if rows else part.reshape(shape))
        return parts

    @functools.cached_property
    def _kinds(self) -> dict[str, list[Array]]:
        return {}

    def parts_in(self, like: Array | None) -> list[Array]:
        """The payload sections as arrays of `like`'s kind and device (the frame's own, `device`, for None), range
        codes expanded to fp16 scales and zero points; views of `raw` on the cpu, copies on another device; made on
        first use: a frame dequantized from its lookup's landing (`FrameRun`) never needs them."""
        if like is None:
            xp, device = target(self.device)
        else:
            xp, device = namespace(like), device_of(like)
        key = f"{is_torch(like) if like is not None else self.device is not None}:{device}"
        if key not in self._kinds:
            parts = [from_host(part, xp, device) for part in self._sections]
            h = self.header
            if h.transform & SPLIT:  # range codes -> fp16 scales and zero points
                parts = expand_split(h.mode, parts, Dims(h.layers, h.kv_heads, h.tokens, h.head_dim), h.group_size,
                                     variant_of(h), hi_of(h))
            self._kinds[key] = parts
        return self._kinds[key]

    @property
    def parts(self) -> list[Array]:
        """`parts_in` the frame's own kind and device."""
        return self.parts_in(None)

    @property
    def kind(self) -> tuple[object, ...]:
        """Every field of the header but its checksum: frames of one kind share their layout (`FrameRun`)."""
        return kind_of(self.header)

    @property
    def splits_by_layer(self) -> bool:
        """Whether `decode_into` takes a part of the layers (packed codes of odd shapes do not)."""
        h = self.header
        if h.layer_bits or h.transform & SPLIT:  # each layer's codes are padded to a byte in these frames
            return True
        return codes_split_by_layer(h.mode, Dims(h.layers, h.kv_heads, h.tokens, h.head_dim), h.group_size)

    def decode_into(self, out: Array | None = None, layers: slice | None = None) -> Array:
        """Dequantize layers `layers` (all by default) into `out` [those layers, 2, kv_heads, tokens,
        head_dim] (any float dtype, a strided view is fine; a numpy array or a torch tensor on any device), or into a
        new array of the frame's dtype (numpy, or a tensor on the frame's `device`).
        An output of another shape raises CodecError and is left untouched."""
        h = self.header
        first, stop, _ = (layers or slice(None)).indices(h.layers)
        count = max(0, stop - first)
        dims = Dims(count, h.kv_heads, h.tokens, h.head_dim)
        shape = [count, 2, h.kv_heads, h.tokens, h.head_dim]
        if out is not None and (list(out.shape) != shape or dtype_name(out) not in FLOATS):
            raise CodecError(f"frame holds {shape}, the output is {list(out.shape)} {out.dtype}")
        variant = variant_of(h)
        whole = self.parts_in(out)
        if out is None and (self.borrowed or h.rows) and h.mode in FLOAT_MODES:  # else it would alias the frame
            xp = namespace(whole[0])
            out = xp.empty(shape, dtype=dtype_in(xp, h.dtype), device=device_of(whole[0]))
        if h.layer_bits or h.transform & V6:  # split frames whose sections are not all layers first
            return self._split_into(whole, out, first, count, variant)
        if count != h.layers:
            if not self.splits_by_layer:
                raise CodecError("this frame's packed codes cannot be split by layer")
            parts = [layer_slice(p, first, count, h.layers) for p in whole]
        else:
            parts = whole
        return dequantize(h.mode, parts, dims, h.group_size, h.dtype, out, variant)

    def _split_into(self, whole: list[Array], out: Array | None, first: int, count: int,
                    variant: Variant) -> Array:
        """`decode_into` of layers [first, first + count) of a split frame whose table gives layers one bit more, or of
        format 6: every section is layers first but the top bits, which hold the raised layers only (a key class
        frame's "pkt" holds every layer's), and "rope", which holds no layer."""
        h = self.header
        hi = hi_of(h)
        full = Dims(h.layers, h.kv_heads, h.tokens, h.head_dim)
        names = list(split_layout(h.mode, full, h.group_size, variant, h.hi_counts))
        parts = []
        for name, part in zip(names, whole, strict=True):
            raised = {"pkt": None if variant.key_classes else hi.up_keys, "pvt": hi.up_values}.get(name)
            if name == "rope":
                parts.append(part)
            elif raised is None:
                parts.append(layer_slice(part, first, count, h.layers))
            else:  # the raised layers' rank among them; none in these layers: no such section
                below = sum(1 for n in raised if n < first)
                inside = sum(1 for n in raised if first <= n < first + count)
                if inside:
                    parts.append(layer_slice(part, below, inside, len(raised)))
        up = tuple(tuple(n - first for n in raised if first <= n < first + count)
                   for raised in (hi.up_keys, hi.up_values))
        dims = Dims(count, h.kv_heads, h.tokens, h.head_dim)
        return dequantize(h.mode, parts, dims, h.group_size, h.dtype, out, variant, (up[0], up[1]))


@dataclass(frozen=True)
class PlacedFrame(OpenFrame):
    """A token-rows frame verified where its rows were received (`verify_placed`): they already lie in the context a
    hit is set from (a llama.cpp sequence state), so it dequantizes into nothing. Its layer 0's first K row lies at
    address `at`, each next layer's `layer_stride` bytes on; an output anywhere else is refused. `at` 0: the rows lie
    apart from every tensor (a q8_0 state, set beside the tensor lent with it), and any output of its shape and dtype
    is left as it is."""

    at: int = 0
    layer_stride: int = 0

    @property
    def splits_by_layer(self) -> bool:
        return True

    def decode_into(self, out: Array | None = None, layers: slice | None = None) -> Array:
        first, stop, _ = (layers or slice(None)).indices(self.header.layers)
        h = self.header
        shape = [max(0, stop - first), 2, h.kv_heads, h.tokens, h.head_dim]
        if (out is None or list(out.shape) != shape or dtype_name(out) != h.dtype or not shape[0]
                or (self.at and ptr(out) != self.at + first * self.layer_stride)):
            raise CodecError("a placed frame's rows lie where they were received; this output is elsewhere")
        return out


class FrameRun:
    """Frames of one kind lying at one stride in one buffer (a lookup's landing, `cachestore.wire`): one layer
    of all of them is dequantized in a single call, straight from the buffer.

    Dequantizing frame after frame writes the whole context before the first layer's attention, and the context
    is larger than the caches (94 MB at 2048 SmolLM2 tokens in fp32): the forward step then reads it back from
    memory. Layer by layer, each layer's KV is written just before its attention reads it, while it is still
    cached; with one call per layer per run instead of one per frame.
    """

    def __init__(self, header: FrameHeader, count: int, stride: int, typed: dict[str, Array],
                 starts: list[int]) -> None:
        self.header, self.count = header, count
        self._stride = stride  # bytes from one frame to the next
        self._typed = typed  # the buffer viewed as each section's dtype (by name)
        self._starts = starts  # each section's first element in frame 0, in its dtype's view of the buffer

    @classmethod
    def of(cls, buffer: Array, frames: list[OpenFrame]) -> FrameRun | None:
        """`frames` as one run over `buffer` (1-D uint8, a numpy array or a cpu tensor: the run's sections are of its
        kind), or None unless each is read in place from it, all at one stride, of one kind (mode, shape, dtype,
        group, transform; no layer table, outlier channels, symmetric values or range codes; codes that split by
        layer)."""
        if not frames or dtype_name(buffer) != "uint8" or buffer.ndim != 1:
            return None
        first = frames[0]
        h = first.header
        kind = kind_of(h)
        if (h.layer_bits or h.rows or h.transform & (SPLIT | SCALE8) or not first.splits_by_layer
                or any(not f.borrowed or kind_of(f.header) != kind for f in frames)):
            return None
        size_of = buffer.shape[0]
        base, end = ptr(buffer), ptr(buffer) + size_of
        origins = [f.address for f in frames]
        stride = origins[1] - origins[0] if len(frames) > 1 else 0
        if (any(o != origins[0] + k * stride for k, o in enumerate(origins)) or origins[0] < base
                or origins[-1] + h.raw_len > end):
            return None
        xp = namespace(buffer)
        sections, offsets, _ = plan(h)
        typed: dict[str, Array] = {}
        starts = []
        for (name, _), offset in zip(sections, offsets, strict=True):
            size = ITEMSIZE[name]
            at = origins[0] - base + offset
            if at % size or stride % size:
                return None
            if name not in typed:
                typed[name] = buffer[: size_of - size_of % size].view(dtype_in(xp, name))
            starts.append(at // size)
        return cls(h, len(frames), stride, typed, starts)

    @property
    def decodes_whole(self) -> bool:
        """Whether `decode_into` takes a call for all the keys and one for all the values (int8); any other kind takes
        one a layer, more calls than decoding its frames one by one."""
        return self.header.mode == "int8" and not self.header.transform

    def decode_into(self, out: Array) -> Array:
        """Every layer of every frame into `out` [layers, 2, kv_heads, frames * tokens, head_dim] (a strided view of a
        context is fine; frame k's tokens at out[:, :, :, k * tokens:(k + 1) * tokens]); returns `out`. int8 takes a
        call for all the keys and one for all the values (into a llama.cpp sequence state's rows: one kernel pass
        each), any other kind a call a layer. An output of another shape raises CodecError and is left untouched."""
        h, n = self.header, self.count
        shape = [h.layers, 2, h.kv_heads, n * h.tokens, h.head_dim]
        if list(out.shape) != shape or dtype_name(out) not in FLOATS:
            raise CodecError(f"a run of {n} frames holds {shape}, the output is {list(out.shape)} {out.dtype}")
        xp = namespace(out)
        framed = xp.permute_dims(reshape_view(out, (h.layers, 2, h.kv_heads, n, h.tokens, h.head_dim)),
                                 (0, 3, 1, 2, 4, 5))  # [layers, frames, 2, heads, tokens, dim]
        if self.decodes_whole:
            sk, sv, qk, qv = self._parts(None)  # [layers, frames, ...] each
            int8_codes_into(framed[:, :, 0], qk, sk)
            int8_codes_into(framed[:, :, 1], qv, sv)
            return out
        for layer in range(h.layers):
            self.decode_layer_into(framed[layer], layer)
        return out

    def decode_layer_into(self, out: Array, layer: int) -> Array:
        """Layer `layer` of every frame into `out` [frames, 2, kv_heads, tokens, head_dim] (a strided view of a
        context is fine; frame k's tokens at out[k]); returns `out`."""
        h, n = self.header, self.count
        variant = variant_of(h)
        parts = [part if dtype_name(part) != "uint8" else namespace(part).reshape(part, (-1,))
                 for part in self.layer_parts(layer)]
        return dequantize(h.mode, parts, Dims(n, h.kv_heads, h.tokens, h.head_dim), h.group_size, h.dtype, out,
                          variant)

    def layer_parts(self, layer: int) -> list[Array]:
        """Layer `layer`'s payload sections of every frame, as strided views of the buffer, frames first (the
        shapes of `cachestore.codec.layout.layout` less its layers; packed codes [frames, a layer's bytes]): int8's
        are key scales [frames, kv_heads, 1, head_dim], value scales [frames, kv_heads, tokens, 1], then the key and the
        value codes [frames, kv_heads, tokens, head_dim]."""
        return self._parts(layer)

    def _parts(self, layer: int | None) -> list[Array]:
        """`layer_parts`, or with `layer` None every layer's, layers first ([layers, frames, ...]; sections of
        packed codes are not split by layer then: [frames, all their bytes])."""
        n, layers = self.count, self.header.layers
        parts = []
        for (name, shape), start in zip(plan(self.header)[0], self._starts, strict=True):
            typed, step = self._typed[name], self._stride // ITEMSIZE[name]
            if len(shape) > 1:  # layers first: frame k's layer is one contiguous block, `step` after frame k-1's
                inner = shape[1:]
                steps: list[int] = []
                acc = 1
                for size in reversed(inner):
                    steps.insert(0, acc)
                    acc *= size
                if layer is None:
                    parts.append(as_strided(typed, (layers, n, *inner), (acc, step, *steps), start))
                else:
                    parts.append(as_strided(typed, (n, *inner), (step, *steps), start + layer * acc))
            else:  # packed codes, layer-major, each layer's on whole bytes (splits_by_layer)
                per = shape[0] // layers if layer is not None else shape[0]
                parts.append(as_strided(typed, (n, per), (step, 1), start + (layer or 0) * per))
        return parts
