"""Frames checked before anything reads them: the header's fields and limits, lengths, and the checksum."""

from __future__ import annotations

from collections.abc import Sequence

from cachestore.codec.compress import compress_bound
from cachestore.codec.frame import HEADER_SIZE, FrameHeader, checksum, checksum_pieces, parse_header
from cachestore.codec.plan import as_bytes, plan
from cachestore.errors import CodecError

DEFAULT_MAX_ELEMENTS = 1 << 28  # 512 MiB of fp16 KV; far above any block


def read_header(frame: bytes | bytearray | memoryview, *,
                max_elements: int = DEFAULT_MAX_ELEMENTS) -> FrameHeader:
    """Parse and validate the header alone: fields, limits and the declared raw length."""
    try:
        header = parse_header(as_bytes(frame), max_elements=max_elements)
        raw_len = plan(header)[2]
    except CodecError:
        raise
    except Exception as exc:  # a frame must never raise anything but CodecError
        raise CodecError(f"invalid frame header: {type(exc).__name__}: {exc}") from exc
    if header.raw_len != raw_len:
        raise CodecError(f"inconsistent frame: raw length {header.raw_len}, the shape needs "
                         f"{raw_len}")
    return header


def verify_frame(frame: bytes | bytearray | memoryview, *,
                 max_elements: int = DEFAULT_MAX_ELEMENTS) -> FrameHeader:
    """Validate header, lengths and checksum without decompressing or dequantizing."""
    view = as_bytes(frame)
    header = read_header(view, max_elements=max_elements)
    stored = len(view) - HEADER_SIZE
    if header.payload_len != stored:
        what = "truncated" if stored < header.payload_len else "oversized"
        raise CodecError(f"{what} frame: payload is {stored} bytes, header says "
                         f"{header.payload_len}")
    if header.payload_len > compress_bound(header.compressor, header.raw_len) + header.table_len:
        raise CodecError(f"payload of {header.payload_len} bytes exceeds the {header.compressor} "
                         f"bound for {header.raw_len} raw bytes")
    if checksum(view[:HEADER_SIZE], view[HEADER_SIZE:]) != header.checksum:
        raise CodecError("checksum mismatch: the frame is corrupt")
    return header


def verify_placed(header_bytes: memoryview, payload: Sequence[memoryview], *, digest: int | None = None,
                  max_elements: int = DEFAULT_MAX_ELEMENTS) -> FrameHeader:
    """`verify_frame` of a frame received apart (`cachestore.wire.Scatter`): its header, and its payload in
    pieces, in order. Only an uncompressed token-rows frame (FLAG_ROWS) is whole where its rows were received.
    `digest`: its checksum already computed over those very bytes as they arrived (`frame.checksum_pieces`)."""
    header = read_header(header_bytes, max_elements=max_elements)
    stored = sum(len(piece) for piece in payload)
    if not header.rows or header.compressor != "none" or not header.payload_len == header.raw_len == stored:
        raise CodecError(f"not an uncompressed token-rows frame of {stored} payload bytes ({header.mode}, "
                         f"{header.compressor}, {header.payload_len} bytes)")
    if (checksum_pieces(header_bytes[:HEADER_SIZE], payload) if digest is None else digest) != header.checksum:
        raise CodecError("checksum mismatch: the frame is corrupt")
    return header


