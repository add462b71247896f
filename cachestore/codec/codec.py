"""The KV block codec: quantize -> pack -> compress -> frame, and back, for untrusted bytes.

    codec = Codec("int4+zstd:3/g64")
    frame = codec.encode(kv)        # kv: [layers, 2, kv_heads, tokens, head_dim]
    kv2 = codec.decode(frame)       # any mode's frame: frames describe themselves

Modes and their loss (see DESIGN.md, "Codec"; every part of a spec: docs/codec-spec.md, generated from
cachestore/codec/spec.py):
    exact  the tensor's own dtype bits; lossless.
    fp16   cast to fp16; lossless only for fp16 input (fp32/bf16 lose mantissa or range).
    int8   symmetric, keys per channel, values per token; error <= half a step per scale.
    int4   asymmetric per group (keys: group_size tokens per channel; values:
    int2   group_size channels per token), fp16 scale and zero; error <= half a step
           (of the clipped range with /clip), within its own bits where options give a
           channel or layer more or fewer.
    q8     llama.cpp's q8_0, always as token rows: per token and head, 32 channels share an fp16
           scale (max |x| / 127); error <= half a step. The bytes of a llama.cpp KV cache of type
           q8_0, which a llamacpp pod stores and restores exactly (service.engines.llamastate).

Storage policy (measured with `kvstash bench codec` on SmolLM2 KV): byte shuffle is used
for exact/fp16 payloads under zstd only (fp16 KV: zstd ratio 1.09 -> 1.18; lz4 gains
nothing). Otherwise zstd cuts its blocks where the payload's sections start (`compress_sections`: each block
has its own entropy tables, and a near-uniform key section beside skewed value codes costs a fixed-size block its
gain). A compressed payload that saves under 2% is stored raw and its frame says compressor "none" (int8 and fp16
KV under lz4), so decoding skips a useless pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from cachestore.codec.arrays import Array, dtype_name, frombuffer, host_bytes, is_torch, name_of, namespace, target
from cachestore.codec.compress import compress, compress_sections, decompress, shuffle, unshuffle
from cachestore.codec.frame import (
    FLAG_ROWS,
    FLAG_SHUFFLE,
    FLOAT_MODES,
    GROUPED_MODES,
    HEADER_SIZE,
    KEY_CLASS_VERSION,
    KEY_CLASSES,
    MAX_DIM,
    MAX_TOKENS,
    ROT_VALUES,
    V6,
    FrameHeader,
    checksum,
    pack_header,
)
from cachestore.codec.layout import PLAIN, Dims, layout
from cachestore.codec.plan import DTYPES, as_bytes, itemsize, plan_of, section_offsets
from cachestore.codec.quant import quantize
from cachestore.codec.rope import Rope
from cachestore.codec.spec import CodecSpec
from cachestore.codec.verify import DEFAULT_MAX_ELEMENTS, verify_frame
from cachestore.codec.views import OpenFrame
from cachestore.errors import CodecError

T = TypeVar("T")
_WORTH = 0.98  # a compressed payload must save 2% or the raw bytes are stored instead
_DEFAULT_SPEC = CodecSpec()


class Codec:
    """Encodes KV tensors with one spec; decodes frames of any spec."""

    def __init__(self, spec: CodecSpec | str = _DEFAULT_SPEC, rope: Rope | None = None) -> None:
        """`rope`: the model's (its engine's `KvLayout.rope`), which a spec with /unrope needs to encode; every
        frame records what its decoding needs."""
        self.spec = CodecSpec.parse(spec) if isinstance(spec, str) else spec
        self.rope = rope

    def __repr__(self) -> str:
        return f"Codec({self.spec.name()!r})"

    def encode(self, kv: Array) -> bytes:
        """kv [layers, 2, kv_heads, tokens, head_dim] (fp32/fp16/bf16; a numpy array, or a torch tensor on any
        device: quantized there, only the payload comes to the host) -> frame. numpy and torch make the same bytes."""
        dims, dtype = _check_input(kv)
        spec = self.spec
        group = spec.group_size if spec.mode in GROUPED_MODES else 0
        sections = layout(spec.mode, dims, group, dtype, spec.hi.counts, spec.variant)
        parts = quantize(spec.mode, kv.detach() if is_torch(kv) else kv, group, spec.variant or PLAIN, spec.hi,
                         self.rope)
        offsets, raw_len = section_offsets(sections)
        raw = np.zeros(raw_len, dtype=np.uint8)
        for (sec_dtype, shape), part, start in zip(sections, parts, offsets, strict=True):
            assert dtype_name(part) == sec_dtype and tuple(part.shape) == shape, (part.shape, shape)
            if spec.rows and spec.mode in FLOAT_MODES:  # [layers, 2, tokens, kv_heads, head_dim]: K and V as token rows
                part = namespace(part).permute_dims(part, (0, 1, 3, 2, 4))
            data = host_bytes(part)  # copies device -> host if needed
            raw[start:start + data.shape[0]] = data
        comp, shuffled = spec.compressor, spec.mode in FLOAT_MODES and spec.compressor == "zstd"
        packed = shuffle(raw, itemsize(spec.mode, dtype)) if shuffled else raw
        view = memoryview(packed.data)
        # a shuffled payload interleaves its sections' bytes; otherwise zstd starts a block at each section
        payload = compress(view, comp, spec.level) if shuffled else compress_sections(view, comp, spec.level, offsets)
        if comp != "none" and len(payload) > raw_len * _WORTH:
            # Incompressible (int8 and fp16 KV under lz4): store it plainly, so decoding
            # skips a decompression that would buy nothing. The frame says so itself.
            comp, shuffled, payload = "none", False, raw.tobytes()
        # The oldest version that holds the frame (1: nothing transformed, 2: rotated values, 5: a split layout, 6:
        # keys without their RoPE or int2's key classes, 7: int4's): older readers keep reading the frames they can.
        table, t = spec.layer_table(dims.layers), spec.transform
        version = (KEY_CLASS_VERSION[spec.mode] if t & KEY_CLASSES else 6 if t & V6 else 5 if t & ~ROT_VALUES
                   else 2 if t else 1)
        stored = table + payload
        flags = (FLAG_SHUFFLE if shuffled else 0) | (FLAG_ROWS if spec.rows else 0)
        header = FrameHeader(version, spec.mode, comp, dtype, flags, group, dims.layers, dims.heads,
                             dims.tokens, dims.head_dim, raw_len, len(stored), 0, spec.transform, table)
        digest = checksum(pack_header(header), stored)
        return pack_header(replace(header, checksum=digest)) + stored

    def plain_size(self, kv_shape: tuple[int, int, int, int, int], dtype: Any) -> int:
        """The length of this spec's frame of KV [layers, 2, kv_heads, tokens, head_dim] in `dtype` (a numpy or torch
        dtype, or its name) when stored plainly (uncompressed; lz4 leaves int8 and fp16 KV so): a lookup reads frames
        of this length in place."""
        layers, _, heads, tokens, dim = kv_shape
        spec = self.spec
        _, _, raw_len = plan_of(spec.mode, layers, heads, tokens, dim,
                                 spec.group_size if spec.mode in GROUPED_MODES else 0,
                                 dtype if isinstance(dtype, str) else name_of(dtype), spec.hi.counts, spec.variant)
        return HEADER_SIZE + len(spec.layer_table(layers)) + raw_len

    def decode(self, frame: bytes | bytearray | memoryview, *, device: Any = None,
               max_elements: int = DEFAULT_MAX_ELEMENTS) -> Array:
        """A frame of any mode -> kv [layers, 2, kv_heads, tokens, head_dim] in its original dtype: a numpy array, or
        with `device` (a torch.device, or a name such as "cpu" or "cuda:0") a torch tensor there. Raises only
        CodecError."""
        return _codec_errors_only(lambda: _decode(as_bytes(frame), device, max_elements))

    def open(self, frame: bytes | bytearray | memoryview, *, device: Any = None,
             max_elements: int = DEFAULT_MAX_ELEMENTS, mac_verified: bool = False) -> OpenFrame:
        """Verify and decompress a frame of any mode, leaving the dequantization for later
        (`OpenFrame.decode_into`, possibly a few layers at a time; without an output into a numpy array, or with
        `device` a torch tensor there, as `decode`). Raises only CodecError. `mac_verified`: as in `verify_frame`."""
        return _codec_errors_only(lambda: _open(as_bytes(frame), device, max_elements, mac_verified))

    def decode_into(self, frame: bytes | bytearray | memoryview, out: Array, *,
                    max_elements: int = DEFAULT_MAX_ELEMENTS) -> Array:
        """Decode a frame of any mode straight into `out` [layers, 2, kv_heads, tokens, head_dim]
        (any float dtype; a numpy array, or a torch tensor on any device; a strided view such as a slice of a larger
        context is fine); returns `out`. A frame whose shape differs from out's raises CodecError, out untouched."""
        return _codec_errors_only(lambda: _open(as_bytes(frame), None, max_elements).decode_into(out))


def _codec_errors_only(decode: Callable[[], T]) -> T:
    """Run a decoding step over untrusted bytes: a frame must never raise anything but CodecError."""
    try:
        return decode()
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc


def _check_input(kv: Array) -> tuple[Dims, str]:
    try:
        namespace(kv)
    except TypeError:
        raise CodecError(f"encode takes a numpy array or a torch tensor, not {type(kv).__name__}") from None
    if kv.ndim != 5 or kv.shape[1] != 2:
        raise CodecError(f"KV must be [layers, 2, kv_heads, tokens, head_dim], got "
                         f"{list(kv.shape)}")
    dtype = dtype_name(kv)
    if dtype not in DTYPES:
        raise CodecError(f"KV dtype {kv.dtype} is not float32, float16 or bfloat16")
    n_layers, _, heads, tokens, dim = kv.shape
    for name, value, limit in (("layers", n_layers, MAX_DIM), ("kv_heads", heads, MAX_DIM),
                               ("tokens", tokens, MAX_TOKENS), ("head_dim", dim, MAX_DIM)):
        if not 1 <= value < limit:
            raise CodecError(f"KV {name} = {value} outside 1..{limit - 1}")
    return Dims(n_layers, heads, tokens, dim), dtype


def _borrow(payload: memoryview, raw_len: int) -> np.ndarray:
    """A uint8 array over the caller's (possibly read-only) bytes, without a copy.

    Nothing writes to it: dequantizing reads these sections once and writes new arrays, and a
    float frame decoded without an output is copied out of it (`OpenFrame.decode_into`).
    """
    if len(payload) != raw_len:
        raise CodecError(f"payload is {len(payload)} bytes, header says {raw_len}")
    return frombuffer(payload)


def _decode(view: memoryview, device: Any, max_elements: int) -> Array:
    return _open(view, device, max_elements).decode_into()


def _open(view: memoryview, device: Any, max_elements: int, mac_verified: bool = False) -> OpenFrame:
    header = verify_frame(view, max_elements=max_elements, mac_verified=mac_verified)
    payload = view[HEADER_SIZE + header.table_len:]
    borrowed = header.compressor == "none"
    if borrowed:  # read in place: an fp16 context of 2048 SmolLM2 tokens would be a 47 MB copy
        buf = _borrow(payload, header.raw_len)
    else:
        buf = frombuffer(decompress(payload, header.compressor, header.raw_len))  # shares the buffer, keeps it alive
    if header.shuffled:
        buf = unshuffle(buf, itemsize(header.mode, header.dtype))
    _, at = target(device)
    on_cpu = at is None or at.type == "cpu"
    frame = OpenFrame(header, buf, borrowed and on_cpu, at)  # parts moved to a device are copies
    if not on_cpu:
        _ = frame.parts  # moved now: a frame opened for a device is whole there
    return frame
