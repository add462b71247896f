"""Payload compression (zstd, lz4, none) with hard output bounds, and the byte-shuffle filter.

Decompression never produces more than the caller's declared raw length: lz4 decodes
into a buffer of exactly that size, zstd streams into a preallocated buffer of that
size and must end exactly there. A stored payload larger than the compressor's
worst-case bound for the raw length is rejected before any work.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import lz4.block
import numpy as np
import zstandard

from cachestore.errors import CodecError

LZ4_MAX_INPUT = 0x7E000000  # LZ4_MAX_INPUT_SIZE of the block format
MIN_SECTION_BLOCK = 4096  # `compress_sections` cuts no block shorter (a block costs a header, maybe tables)


def compress_bound(compressor: str, raw_len: int) -> int:
    """The largest stored payload a well-formed frame can have for `raw_len` raw bytes."""
    if compressor == "none":
        return raw_len
    if compressor == "lz4":
        return raw_len + raw_len // 255 + 16
    # ZSTD_COMPRESSBOUND, plus room for the frame header and checksum.
    small = ((128 << 10) - raw_len) >> 11 if raw_len < (128 << 10) else 0
    return raw_len + (raw_len >> 8) + small + 32


def compress(raw: bytes | bytearray | memoryview, compressor: str, level: int) -> bytes:
    """Compress `raw` with `compressor` ("none" returns the bytes as they are)."""
    if compressor == "none":
        return bytes(raw)
    if compressor == "lz4":
        if len(raw) > LZ4_MAX_INPUT:
            raise CodecError(f"payload of {len(raw)} bytes is too large for lz4")
        return lz4.block.compress(raw, store_size=False)
    if compressor == "zstd":
        return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    raise CodecError(f"unknown compressor {compressor!r}")


def compress_sections(raw: bytes | bytearray | memoryview, compressor: str, level: int,
                      starts: Sequence[int]) -> bytes:
    """`compress`, with zstd ending a block at each of `starts` (byte offsets into `raw`).

    Still one standard zstd frame, which any reader decompresses as before. Each block has its own entropy
    tables and zstd stores a block raw when they would save little, so a payload whose sections differ (key
    codes near uniform, value codes skewed) compresses much better with its blocks cut where the sections are
    than with blocks of a fixed size that mix them."""
    if compressor != "zstd":
        return compress(raw, compressor, level)
    view = memoryview(raw)
    cuts = [0]
    for start in sorted(starts):  # a block of its own for every section that is not small, the small ones joined
        if start - cuts[-1] >= MIN_SECTION_BLOCK and len(view) - start >= MIN_SECTION_BLOCK:
            cuts.append(start)
    if len(cuts) == 1:
        return compress(raw, compressor, level)
    cobj = zstandard.ZstdCompressor(level=level, write_content_size=True).compressobj(size=len(view))
    out = []
    for lo, hi in itertools.pairwise([*cuts, len(view)]):
        out.append(cobj.compress(view[lo:hi]))
        out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(cobj.flush())
    return b"".join(out)


def decompress(payload: memoryview, compressor: str, raw_len: int) -> bytearray:
    """Decompress `payload` into a new buffer of exactly `raw_len` bytes, or raise CodecError."""
    if len(payload) > compress_bound(compressor, raw_len):
        raise CodecError(f"payload of {len(payload)} bytes exceeds the {compressor} bound "
                         f"for {raw_len} raw bytes")
    if compressor == "none":
        if len(payload) != raw_len:
            raise CodecError(f"payload is {len(payload)} bytes, header says {raw_len}")
        return bytearray(payload)
    if compressor == "lz4":
        return _lz4_decompress(payload, raw_len)
    if compressor == "zstd":
        return _zstd_decompress(payload, raw_len)
    raise CodecError(f"unknown compressor {compressor!r}")


def _lz4_decompress(payload: memoryview, raw_len: int) -> bytearray:
    if raw_len > LZ4_MAX_INPUT:
        raise CodecError(f"raw length {raw_len} is too large for lz4")
    try:
        out = lz4.block.decompress(payload, uncompressed_size=raw_len, return_bytearray=True)
    except lz4.block.LZ4BlockError as exc:
        raise CodecError(f"corrupt lz4 payload: {exc}") from exc
    if len(out) != raw_len:
        raise CodecError(f"lz4 payload decodes to {len(out)} bytes, header says {raw_len}")
    return out


def _zstd_decompress(payload: memoryview, raw_len: int) -> bytearray:
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd payload: {exc}") from exc
    if params.content_size != raw_len:
        raise CodecError(f"zstd frame declares {params.content_size} bytes, header says {raw_len}")
    out = bytearray(raw_len)
    view = memoryview(out)
    filled = 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(payload) as reader:
            while filled < raw_len:
                got = reader.readinto(view[filled:])
                if not got:
                    break
                filled += got
            extra = reader.read(1)
    except zstandard.ZstdError as exc:
        raise CodecError(f"corrupt zstd payload: {exc}") from exc
    if filled != raw_len or extra:
        raise CodecError(f"zstd payload does not decode to exactly {raw_len} bytes")
    return out


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Byte shuffle: all first bytes of the elements, then all second bytes, ...

    raw: uint8 [n * itemsize] -> uint8 [n * itemsize]; exponent bytes of floats end up
    side by side, which is what lets lz4/zstd find their redundancy.
    """
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The inverse of `shuffle`: uint8 [itemsize * n] -> uint8 [n * itemsize]."""
    return np.ascontiguousarray(raw.reshape(itemsize, -1).T).reshape(-1)
