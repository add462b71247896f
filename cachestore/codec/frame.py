"""The kvstash frame header: pack, parse and validate it, and checksum a frame.

A frame is a fixed 52-byte little-endian header followed by the payload:

    offset size field
         0    4 magic            b"KVS1"
         4    1 format version   1, 2, 5, 6 or 7 (3, 4 and mode 6, fp8, are retired: `RetiredFrame`)
         5    1 mode             MODES code
         6    1 compressor       COMPRESSORS code
         7    1 dtype            DTYPES code (the tensor's dtype before encoding)
         8    1 flags            FLAG_SHUFFLE (bit 0), FLAG_ROWS (bit 1, exact and fp16, always
                                 with q8: the payload holds [layers, 2, tokens, kv_heads, head_dim],
                                 each layer's keys and values as token rows, the order of a llama.cpp
                                 sequence state's K and V; q8's rows are llama.cpp's q8_0 blocks);
                                 other bits must be zero
         9    1 transform        int4/int2 only. Version 1: zero. Version 2: ROT_VALUES (bit 1) alone,
                                 values rotated along head_dim before quantizing. Version 5: SCALE8
                                 (bit 5) with OUTLIER_KEYS (bit 3) and/or SYM_VALUES (bit 4), ROT_VALUES
                                 and LAYER_TABLE (bit 2) optional: every group's range stored as two
                                 8-bit codes between the fp16 extremes of its block
                                 (`cachestore.codec.scalecodes`), each key group's widest channels at
                                 higher precision (`outlier_channels`), values quantized symmetrically.
                                 Version 6: as 5, with KEY_CLASSES (bit 6; not with OUTLIER_KEYS: each
                                 key group's channels in four classes of fixed counts, `key_classes`;
                                 int2 only) and/or UNROPE (bit 7: keys stored with RoPE undone relative
                                 to the block's first token, the inverse frequencies and pairing in the
                                 payload's first section, `cachestore.codec.rope`). Version 7: as 6,
                                 int4's KEY_CLASSES
        10    2 group size       int4/int2 only, else zero
        12    4 layers
        16    4 kv heads
        20    4 tokens
        24    4 head dim
        28    8 raw length       payload bytes after decompression (the layer table not included)
        36    8 payload length   payload bytes as stored (== frame length - 52; the table included)
        44    8 checksum         xxh3_64 of header bytes 0..43 followed by the stored payload
        52    L layer table      with LAYER_TABLE only, stored uncompressed at the start of the payload:
                                 one byte per layer, key bits (low nibble) and value bits (high nibble),
                                 each the mode's (4 or 2) or one more (UP_BITS: 5 or 3; values only
                                 with KEY_CLASSES); at least one differs from the mode's

The tensor the frame holds is [layers, 2, kv_heads, tokens, head_dim]; index 0 is keys.

A writer gives each frame the oldest version that holds it, so frames of the plain codecs stay version 1. A cache
owes old frames nothing: a frame of a retired format (versions 3 and 4, fp8, rotated keys, range codes without a
split layout, int4 key classes of version 6) raises `RetiredFrame`, which a pod counts as a miss.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from cachestore.errors import CodecError, RetiredFrame

MAGIC = b"KVS1"
FORMAT_VERSION = 7  # the newest this module reads and writes
VERSIONS = (1, 2, 5, 6, 7)
RETIRED_VERSIONS = (3, 4)
HEADER = struct.Struct("<4sBBBBBBHIIIIQQQ")
HEADER_SIZE = HEADER.size  # 52
_CHECKED = HEADER_SIZE - 8  # the checksum covers the header up to the checksum itself

MODES = {"exact": 1, "fp16": 2, "int8": 3, "int4": 4, "int2": 5, "q8": 7}
RETIRED_MODES = {6: "fp8"}
COMPRESSORS = {"none": 0, "lz4": 1, "zstd": 2}
DTYPES = {"float32": 1, "float16": 2, "bfloat16": 3}
GROUPED_MODES = ("int4", "int2")
FLOAT_MODES = ("exact", "fp16")  # payloads made of 2- or 4-byte floats: byte shuffle may apply
ROWS_MODES = (*FLOAT_MODES, "q8")  # payloads that may be token rows (FLAG_ROWS); q8's always are

FLAG_SHUFFLE = 1
FLAG_ROWS = 2
_KNOWN_FLAGS = FLAG_SHUFFLE | FLAG_ROWS
ROT_KEYS, ROT_VALUES, LAYER_TABLE, OUTLIER_KEYS, SYM_VALUES, SCALE8 = 1, 2, 4, 8, 16, 32  # ROT_KEYS: retired
KEY_CLASSES, UNROPE = 64, 128
SPLIT = OUTLIER_KEYS | SYM_VALUES | KEY_CLASSES  # the transforms that take `split_layout` (versions 5 to 7)
V6 = KEY_CLASSES | UNROPE  # the transforms of versions 6 and 7
_KNOWN_TRANSFORMS = ROT_VALUES | LAYER_TABLE | SPLIT | SCALE8 | UNROPE
MODE_BITS = {"int4": 4, "int2": 2}  # bits per code of the grouped modes
# OUTLIER_KEYS: in every key group, head_dim // OUTLIER_SHARE[mode] channels (the widest) take OUTLIER_BITS[mode]; the
# shares are multiples of 8, so a head_dim they divide fills the channel mask's bytes
OUTLIER_SHARE = {"int4": 16, "int2": 8}
OUTLIER_BITS = {"int4": 8, "int2": 4}
UP_BITS = {"int4": 5, "int2": 3}  # one bit more than the mode's, which a layer table may give a layer's keys or values
# KEY_CLASSES: of every 64 key channels of a group, how many take each class's bits, ranked by importance
# (`quant._class_keys`): fixed counts keep every section's size a function of the header. int2: 0 bits (the group's
# zero point alone), the mode's 2, one more and OUTLIER_BITS; 13/17/26/8 cost 144 bits a token and 64 channels, as
# int2's 8 outlier channels do. int4: one bit less than the mode's to two more, 16/24/16/8: 4.25 bits a channel.
KEY_CLASS_BITS = {"int2": (0, 2, 3, 4), "int4": (3, 4, 5, 6)}
KEY_CLASS_COUNTS = {"int2": (13, 17, 26, 8), "int4": (16, 24, 16, 8)}
KEY_CLASS_VERSION = {"int2": 6, "int4": 7}  # the frame version of each mode's KEY_CLASSES frames
KEY_CLASS_SPAN = 64

MIN_GROUP, MAX_GROUP = 4, 1024
MAX_DIM = 1 << 16  # layers, kv heads and head dim each stay below this
MAX_TOKENS = 1 << 24

_MODE_NAMES = {v: k for k, v in MODES.items()}
_COMPRESSOR_NAMES = {v: k for k, v in COMPRESSORS.items()}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class FrameHeader:
    """The decoded, validated header of one frame."""

    version: int
    mode: str
    compressor: str
    dtype: str
    flags: int
    group_size: int
    layers: int
    kv_heads: int
    tokens: int
    head_dim: int
    raw_len: int
    payload_len: int
    checksum: int
    transform: int = 0  # ROT_VALUES | LAYER_TABLE | ... bits (versions 2 and later)
    layer_bits: bytes = b""  # with LAYER_TABLE: the layer table, one byte per layer; empty otherwise

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def elements(self) -> int:
        return self.layers * 2 * self.kv_heads * self.tokens * self.head_dim

    @property
    def shuffled(self) -> bool:
        return bool(self.flags & FLAG_SHUFFLE)

    @property
    def rows(self) -> bool:
        """The payload holds [layers, 2, tokens, kv_heads, head_dim] (FLAG_ROWS), not [layers, 2, kv_heads, ...]."""
        return bool(self.flags & FLAG_ROWS)

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.payload_len

    @property
    def table_len(self) -> int:
        """Bytes of the layer table at the start of the stored payload (0 without LAYER_TABLE)."""
        return len(self.layer_bits)

    def up_layers(self, half: int) -> tuple[int, ...]:
        """Layers whose keys (half 0) or values (half 1) the layer table gives one bit more than the mode's."""
        return tuple(i for i, b in enumerate(self.layer_bits) if (b >> (4 * half)) & 0xF == UP_BITS[self.mode])

    @property
    def hi_counts(self) -> tuple[int, int]:
        """How many layers' keys / values take one bit more (UP_BITS): what the payload's layout depends on."""
        return (len(self.up_layers(0)), len(self.up_layers(1))) if self.layer_bits else (0, 0)


def outlier_channels(mode: str, head_dim: int) -> int:
    """How many channels of each key group an OUTLIER_KEYS frame of `mode` keeps at OUTLIER_BITS."""
    return head_dim // OUTLIER_SHARE[mode]


def key_classes(mode: str, head_dim: int) -> tuple[int, ...]:
    """How many channels of each key group of a KEY_CLASSES frame of `mode` take each of its KEY_CLASS_BITS."""
    return tuple(n * (head_dim // KEY_CLASS_SPAN) for n in KEY_CLASS_COUNTS[mode])


def key_classes_fit(mode: str, head_dim: int) -> bool:
    """Whether KV of `head_dim` channels can take KEY_CLASSES under `mode`."""
    return mode in KEY_CLASS_BITS and head_dim % KEY_CLASS_SPAN == 0


def key_class_pieces(bits: int) -> tuple[tuple[int, int], ...]:
    """A class's codes of `bits` as stored: (width, shift) pieces, the widest the low bits (3: 2 + 1 above them)."""
    pieces, shift = [], 0
    for width in (8, 4, 2, 1):
        if bits & width:
            pieces.append((width, shift))
            shift += width
    return tuple(pieces)


def key_class_shifts(mode: str, width: int) -> tuple[int | None, ...]:
    """For each of the mode's key classes, where its piece of `width` bits sits in its codes (its shift), or None
    where it has no piece of that width."""
    return tuple(next((shift for w, shift in key_class_pieces(b) if w == width), None) for b in KEY_CLASS_BITS[mode])


def key_class_streams(mode: str) -> tuple[int, ...]:
    """The code widths a KEY_CLASSES frame of `mode` stores, in section order ("pk", "pko", "pkt" of
    `layout.split_layout`): the mode's bits, then the other widths, 1 last. Each holds, token by token, the piece of
    that width of every channel that has one (`key_class_pieces`), in channel order."""
    widths = {w for b in KEY_CLASS_BITS[mode] for w, _ in key_class_pieces(b)}
    others = sorted(widths - {MODE_BITS[mode], 1}, reverse=True)
    return (MODE_BITS[mode], *others, *([1] if 1 in widths else []))


def outlier_fits(mode: str, head_dim: int) -> bool:
    """Whether KV of `head_dim` channels can take OUTLIER_KEYS under `mode`: its share divides head_dim."""
    return head_dim % OUTLIER_SHARE[mode] == 0


def pack_header(h: FrameHeader) -> bytes:
    """The 52 header bytes of `h`; the checksum field is written as given."""
    return HEADER.pack(
        MAGIC, h.version, MODES[h.mode], COMPRESSORS[h.compressor], DTYPES[h.dtype], h.flags, h.transform,
        h.group_size, h.layers, h.kv_heads, h.tokens, h.head_dim, h.raw_len, h.payload_len,
        h.checksum,
    )


def checksum(header_bytes: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3_64 over the header (without its checksum field) and the stored payload."""
    digest = xxhash.xxh3_64()
    digest.update(header_bytes[:_CHECKED])
    digest.update(payload)
    return digest.intdigest()


class RunningChecksum:
    """`checksum` of a frame fed in pieces as they arrive: its header first (all of it, in one piece), then its stored
    payload. `fed` counts the bytes fed, the header's whole."""

    __slots__ = ("_digest", "fed")

    def __init__(self) -> None:
        self._digest = xxhash.xxh3_64()
        self.fed = 0

    def __call__(self, piece: bytes | memoryview) -> None:
        self._digest.update(piece if self.fed else piece[:_CHECKED])
        self.fed += len(piece)

    def value(self) -> int:
        return self._digest.intdigest()


def checksum_pieces(header_bytes: bytes | memoryview, payload: Iterable[bytes | memoryview]) -> int:
    """`checksum` of a stored payload that lies in pieces (received apart: `cachestore.wire.Scatter`), in order."""
    running = RunningChecksum()
    running(header_bytes[:HEADER_SIZE])
    for piece in payload:
        running(piece)
    return running.value()


def parse_header(buf: bytes | memoryview, *, max_elements: int) -> FrameHeader:
    """Parse and validate the header at the start of `buf` (fields only, not the payload)."""
    if len(buf) < HEADER_SIZE:
        raise CodecError(f"truncated frame: {len(buf)} bytes, the header alone needs {HEADER_SIZE}")
    (magic, version, mode, comp, dtype, flags, transform, group, layers, heads, tokens, dim,
     raw_len, payload_len, digest) = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CodecError(f"not a kvstash frame: bad magic {bytes(magic)!r}")
    _check_retired(version, mode, transform)
    if version not in VERSIONS:
        raise CodecError(f"unsupported frame format version {version} (this reader knows "
                         f"{', '.join(map(str, VERSIONS))})")
    if mode not in _MODE_NAMES:
        raise CodecError(f"unknown mode code {mode}")
    if comp not in _COMPRESSOR_NAMES:
        raise CodecError(f"unknown compressor code {comp}")
    if dtype not in _DTYPE_NAMES:
        raise CodecError(f"unknown dtype code {dtype}")
    mode_name = _MODE_NAMES[mode]
    if flags & ~_KNOWN_FLAGS:
        raise CodecError(f"unknown flags {flags:#x}")
    if transform & ~_KNOWN_TRANSFORMS or (transform and mode_name not in GROUPED_MODES):
        raise CodecError(f"unknown transform {transform:#x} for mode {mode_name}")
    expected = (1 if not transform else 2 if transform == ROT_VALUES else 5 if not transform & V6
                else KEY_CLASS_VERSION[mode_name] if transform & KEY_CLASSES else 6)
    if version != expected or (version >= 5 and not (transform & SCALE8 and transform & SPLIT)):
        raise CodecError(f"inconsistent frame: transform {transform:#x} in version {version}")
    if transform & OUTLIER_KEYS and not outlier_fits(mode_name, dim):
        raise CodecError(f"inconsistent frame: outlier key channels with head_dim {dim}")
    if transform & KEY_CLASSES and (transform & OUTLIER_KEYS or not key_classes_fit(mode_name, dim)):
        raise CodecError(f"inconsistent frame: key channel classes in {mode_name} with head_dim {dim}"
                         f"{' and outlier channels' if transform & OUTLIER_KEYS else ''}")
    if transform & UNROPE and (not transform & SPLIT or dim % 2):
        raise CodecError(f"inconsistent frame: keys without their RoPE need a split layout and an even head_dim, "
                         f"not transform {transform:#x} and head_dim {dim}")
    if flags & FLAG_SHUFFLE and mode_name not in FLOAT_MODES:
        raise CodecError(f"inconsistent frame: byte shuffle flag on mode {mode_name}")
    if flags & FLAG_ROWS and mode_name not in ROWS_MODES:
        raise CodecError(f"inconsistent frame: token rows flag on mode {mode_name}")
    if mode_name == "q8" and not flags & FLAG_ROWS:
        raise CodecError("inconsistent frame: a q8 frame without the token rows flag")
    if mode_name in GROUPED_MODES:
        if not MIN_GROUP <= group <= MAX_GROUP:
            raise CodecError(f"group size {group} outside {MIN_GROUP}..{MAX_GROUP}")
    elif group:
        raise CodecError(f"inconsistent frame: group size {group} on mode {mode_name}")
    for name, value, limit in (("layers", layers, MAX_DIM), ("kv_heads", heads, MAX_DIM),
                               ("tokens", tokens, MAX_TOKENS), ("head_dim", dim, MAX_DIM)):
        if not 1 <= value < limit:
            raise CodecError(f"{name} = {value} outside 1..{limit - 1}")
    table = (_layer_table(buf, mode_name, layers, payload_len, bool(transform & KEY_CLASSES))
             if transform & LAYER_TABLE else b"")
    header = FrameHeader(version, mode_name, _COMPRESSOR_NAMES[comp], _DTYPE_NAMES[dtype], flags,
                         group, layers, heads, tokens, dim, raw_len, payload_len, digest, transform, table)
    if header.elements > max_elements:
        raise CodecError(f"oversized frame: {header.elements} elements > limit {max_elements}")
    return header


def _check_retired(version: int, mode: int, transform: int) -> None:
    """RetiredFrame if the header's version, mode or transform is one only retired codecs wrote: a counted miss."""
    if version in RETIRED_VERSIONS or mode in RETIRED_MODES or (version in VERSIONS and transform & ROT_KEYS):
        raise RetiredFrame(f"a frame of a retired format (version {version}, mode code {mode}, transform "
                           f"{transform:#x}): kvstash no longer reads it")
    if (version == 5 and not transform & SPLIT) or (version == 6 and mode == MODES["int4"] and transform & KEY_CLASSES):
        raise RetiredFrame(f"a frame of a retired format (version {version}, transform {transform:#x})")


def _layer_table(buf: bytes | memoryview, mode: str, layers: int, payload_len: int, classes: bool = False) -> bytes:
    """The layer table that follows the header, checked byte by byte: layers at the mode's bits or one more (keys at
    the mode's alone in a frame with key classes)."""
    if payload_len < layers or len(buf) < HEADER_SIZE + layers:
        raise CodecError(f"truncated frame: the layer table needs {layers} bytes after the header")
    table = bytes(buf[HEADER_SIZE:HEADER_SIZE + layers])
    allowed = {MODE_BITS[mode], UP_BITS[mode]}
    for layer, entry in enumerate(table):
        if entry & 0xF not in ({MODE_BITS[mode]} if classes else allowed) or entry >> 4 not in allowed:
            raise CodecError(f"layer table: layer {layer} has key/value bits {entry & 0xF}/{entry >> 4}, "
                             f"{mode} frames allow {', '.join(map(str, sorted(allowed)))}")
    if all(entry == MODE_BITS[mode] * 0x11 for entry in table):
        raise CodecError("inconsistent frame: a layer table that raises no layer")
    return table
