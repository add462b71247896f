"""The KV block codec: quantize -> pack -> compress -> frame, and back, for untrusted bytes.

    codec = Codec("int4+zstd:3/g64")
    frame = codec.encode(kv)        # kv: [layers, 2, kv_heads, tokens, head_dim]
    kv2 = codec.decode(frame)       # any mode's frame: frames describe themselves

Modes and their loss (see DESIGN.md, "Codec"):
    exact  the tensor's own dtype bits; lossless.
    fp16   cast to fp16; lossless only for fp16 input (fp32/bf16 lose mantissa or range).
    int8   symmetric, keys per channel, values per token; error <= half a step per scale.
    int4   asymmetric per group (keys: group_size tokens per channel; values:
    int2   group_size channels per token), fp16 scale and zero; error <= half a step
           (of the clipped range with /clip). Options, part of the name: /rot (keys and
           values Hadamard-rotated along head_dim), /rotk, /rotv (one of them), /clip
           (MSE-chosen group ranges), /plain (none: the format 1 codec). A bare int4 is
           /plain, a bare int2 /rotv/clip (DEFAULT_VARIANTS). /k8=L.L... and /v8=L.L... keep
           the keys / values of those layers at int8 (int8's bound there; frame format 3);
           /k4= and /v4= give those of an int2 frame int4, /k2= and /v2= those of an int4
           frame int2 (that mode's bound there): a per-layer bit allocation, calibrated with
           `kvstash bench layers` on texts the claims are not made on (docs/fidelity.md).
           /recent=int8 (or int4 under int2) encodes a sequence's partial last block, its most
           recent tokens (a session's partial block, a tail), with that mode instead (`recent_spec`;
           cachestore.blockcodec); full blocks are unchanged.
    fp8    e4m3 with a per-channel fp16 scale; relative error <= 2**-4.
    q8     llama.cpp's q8_0, always as token rows: per token and head, 32 channels share an fp16
           scale (max |x| / 127); error <= half a step. The bytes of a llama.cpp KV cache of type
           q8_0, which a llamacpp pod stores and restores exactly (service.engines.llamastate).

Storage policy (measured with `kvstash bench codec` on SmolLM2 KV): byte shuffle is used
for exact/fp16 payloads under zstd only (fp16 KV: zstd ratio 1.09 -> 1.18; lz4 gains
nothing). A compressed payload that saves under 3% is stored raw and its frame says
compressor "none" (int8 and fp16 KV under lz4), so decoding skips a useless pass.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from cachestore.compress import compress, compress_bound, decompress, shuffle, unshuffle
from cachestore.errors import CodecError, ConfigError
from cachestore.frame import (
    COMPRESSORS,
    FLAG_ROWS,
    FLAG_SHUFFLE,
    FLOAT_MODES,
    GROUPED_MODES,
    HEADER_SIZE,
    HI_BITS,
    LAYER_TABLE,
    MAX_DIM,
    MAX_GROUP,
    MAX_TOKENS,
    MIN_GROUP,
    MODES,
    ROT_KEYS,
    ROT_VALUES,
    ROWS_MODES,
    FrameHeader,
    checksum,
    checksum_pieces,
    pack_header,
    parse_header,
)
from cachestore.quant import (
    ALT_BITS,
    BITS,
    NO_HI,
    PLAIN,
    Q8_BLOCK,
    Dims,
    HiLayers,
    Section,
    Variant,
    codes_split_by_layer,
    dequantize,
    dequantize_mixed,
    int8_codes_into,
    layout,
    quantize,
)

__all__ = ["DEFAULT_MAX_ELEMENTS", "RECENT_MODES", "Codec", "CodecSpec", "FrameHeader", "FrameRun", "OpenFrame",
           "PlacedFrame", "read_header", "recent_spec", "verify_frame", "verify_placed"]

T = TypeVar("T")
DEFAULT_MAX_ELEMENTS = 1 << 28  # 512 MiB of fp16 KV; far above any block
DEFAULT_GROUP = 64  # measured against 32 on SmolLM2 KV: see ops/bench/codec.py --groups
_ALIGN = 8
_WORTH = 0.97  # a compressed payload must save 3% or the raw bytes are stored instead
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_SPEC = re.compile(r"(?P<mode>[a-z0-9]+)(?:\+(?P<comp>[a-z0-9]+)(?::(?P<level>-?\d+))?)?"
                   r"(?:/g(?P<group>\d+))?(?P<options>(?:/[a-z]+)*)"
                   r"(?:/k8=(?P<k8>\d{1,5}(?:\.\d{1,5})*))?(?:/v8=(?P<v8>\d{1,5}(?:\.\d{1,5})*))?"
                   r"(?:/k(?P<ka_bits>[24])=(?P<ka>\d{1,5}(?:\.\d{1,5})*))?"
                   r"(?:/v(?P<va_bits>[24])=(?P<va>\d{1,5}(?:\.\d{1,5})*))?"
                   r"(?:/recent=(?P<recent>[a-z0-9]+))?")
# int4/int2 options as spec text; "rot" is "rotk" and "rotv" together.
_OPTIONS = {"rot": Variant(True, True), "rotk": Variant(rot_keys=True),
            "rotv": Variant(rot_values=True), "clip": Variant(clip=True), "plain": PLAIN}
# What a bare "int4" / "int2" means, chosen with `kvstash bench quality` on SmolLM2's calibration texts.
# int2 needs clipping above all and rotated values: with both its perplexity change fell by about an order
# of magnitude. int4 stays plain: /rot lowers its KL but not its perplexity change (within noise), and its
# second 64x64 matmul per decode made it slower than the format-1 int4, which the decode-speed target
# forbids; /rotv was a wash. Both stay available by name.
DEFAULT_VARIANTS = {"int4": PLAIN,
                    "int2": Variant(rot_values=True, clip=True)}
# /recent=MODE: what the partial last block of a sequence (its most recent tokens, at most a block less one) may be
# encoded with instead of the mode itself, as KIVI keeps the most recent tokens at full precision
RECENT_MODES = {"int4": ("int8",), "int2": ("int8", "int4")}


@dataclass(frozen=True)
class CodecSpec:
    """What a codec does. Fields a mode ignores are normalised to their defaults, so specs
    that encode identically compare (and name) identically."""

    mode: str = "int8"  # "exact" | "fp16" | "int8" | "int4" | "int2" | "fp8" | "q8"
    compressor: str = "lz4"  # "zstd" | "lz4" | "none"
    level: int = 3  # zstd level, 1..22
    group_size: int = DEFAULT_GROUP  # int4/int2 group size
    variant: Variant | None = None  # int4/int2 options; None: DEFAULT_VARIANTS of the mode
    hi: HiLayers = NO_HI  # int4/int2: layers whose keys / values are kept at int8 or take the other grouped bits
    rows: bool = False  # exact/fp16: payloads as token rows (FLAG_ROWS), the layout of a llama.cpp state's K and V;
    # q8: always
    recent: str = ""  # int4/int2: the mode of a sequence's partial last block (its most recent tokens); "": its own

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown codec mode {self.mode!r}; one of {', '.join(MODES)}")
        if self.rows and self.mode not in ROWS_MODES:
            raise ConfigError(f"token rows (/rows) apply to {', '.join(ROWS_MODES)} only, not {self.mode}")
        if self.mode == "q8":
            object.__setattr__(self, "rows", True)
        if self.compressor not in COMPRESSORS:
            raise ConfigError(f"unknown compressor {self.compressor!r}; one of "
                              f"{', '.join(COMPRESSORS)}")
        if self.compressor == "zstd" and not 1 <= self.level <= 22:
            raise ConfigError(f"zstd level {self.level} outside 1..22")
        if self.mode in GROUPED_MODES and not MIN_GROUP <= self.group_size <= MAX_GROUP:
            raise ConfigError(f"group size {self.group_size} outside {MIN_GROUP}..{MAX_GROUP}")
        if self.compressor != "zstd":
            object.__setattr__(self, "level", 3)
        if any(not 0 <= layer < MAX_DIM for layer in _all_layers(self.hi)):
            raise ConfigError(f"per-layer bits {self.hi} outside layers 0..{MAX_DIM - 1}")
        object.__setattr__(self, "hi", HiLayers(*(tuple(sorted(set(h))) for h in self.hi)))
        if set(self.hi.keys) & set(self.hi.alt_keys) or set(self.hi.values) & set(self.hi.alt_values):
            raise ConfigError(f"per-layer bits {self.hi}: a layer's keys or values are given two precisions")
        if self.mode not in GROUPED_MODES:
            object.__setattr__(self, "group_size", DEFAULT_GROUP)
            object.__setattr__(self, "variant", PLAIN)
            object.__setattr__(self, "hi", NO_HI)
        elif self.variant is None:
            object.__setattr__(self, "variant", DEFAULT_VARIANTS[self.mode])
        _check_recent(self.mode, self.recent)

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Parse "MODE[+COMPRESSOR[:LEVEL]][/gGROUP][/OPTION...][/k8=L.L...][/v8=L.L...][/kB=L.L...][/vB=L.L...]
        [/recent=MODE]",
        e.g. "int8", "int4+zstd:3/g32", "int2/g32/rotv/clip", "int4+zstd/k8=0.1", "int2+zstd/k4=0.1/v4=3",
        "fp16+none/rows", "int2+zstd/k4=2/recent=int8" (options: rot, rotk, rotv, clip, plain; k8/v8: layers whose
        keys/values stay int8; kB/vB: layers whose keys/values take the other grouped precision, B = 4 in int2, 2 in
        int4; int4/int2 only, in this order. rows: exact/fp16; q8 is always token rows. recent, last: the mode of
        the partial last block, RECENT_MODES)."""
        match = _SPEC.fullmatch(text.strip().lower()) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(f"bad codec spec {text!r}; expected MODE[+COMPRESSOR[:LEVEL]][/gN][/OPTION]"
                              f"[/k8=L.L][/v8=L.L][/k4=L.L][/v4=L.L][/recent=MODE] (int2; /k2=, /v2= in int4)")
        mode, comp = match["mode"], match["comp"] or "lz4"
        if match["level"] is not None and comp != "zstd":
            raise ConfigError(f"bad codec spec {text!r}: a level applies to zstd only")
        if match["group"] is not None and mode not in GROUPED_MODES:
            raise ConfigError(f"bad codec spec {text!r}: a group size applies to int4/int2 only")
        level = int(match["level"]) if match["level"] is not None else 3
        group = int(match["group"]) if match["group"] is not None else DEFAULT_GROUP
        hi = HiLayers(*(_parse_layers(text, mode, match[name]) for name in ("k8", "v8", "ka", "va")))
        for name in ("ka_bits", "va_bits"):
            if match[name] is not None and (mode not in ALT_BITS or int(match[name]) != ALT_BITS[mode]):
                raise ConfigError(f"bad codec spec {text!r}: /{name[0]}{match[name]}= applies to "
                                  f"{'int2' if match[name] == '4' else 'int4'} only (the other grouped precision)")
        options = [o for o in match["options"].split("/") if o]
        rows = options[-1:] == ["rows"]
        return cls(mode=mode, compressor=comp, level=level, group_size=group,
                   variant=_parse_options(text, mode, options[:-1] if rows else options), hi=hi, rows=rows,
                   recent=match["recent"] or "")

    def name(self) -> str:
        """Canonical text of this spec; parse(name()) == self. Part of model fingerprints."""
        text = f"{self.mode}+{self.compressor}"
        if self.compressor == "zstd":
            text += f":{self.level}"
        if self.mode in GROUPED_MODES:
            text += f"/g{self.group_size}" + _options_text(self.variant or PLAIN)
            alt = ALT_BITS[self.mode]
            for name, layers in zip(("k8", "v8", f"k{alt}", f"v{alt}"), self.hi, strict=True):
                if layers:
                    text += f"/{name}=" + ".".join(map(str, layers))
        return text + ("/rows" if self.rows and self.mode in FLOAT_MODES else "") + _recent_text(self.recent)

    def check_layers(self, num_layers: int) -> None:
        """ConfigError unless every /k8= and /v8= layer exists in a model of `num_layers` layers (they are one
        model's calibration: a pod whose model lacks them would drop every write)."""
        beyond = [n for n in _all_layers(self.hi) if n >= num_layers]
        if beyond:
            top = max(beyond)
            at = "int8" if top in (*self.hi.keys, *self.hi.values) else f"{ALT_BITS[self.mode]} bits"
            raise ConfigError(f"codec {self.name()} keeps layer {top} at {at}, but the model has layers "
                              f"0-{num_layers - 1}: /k8= and /v8= name one model's layers")

    def check_model(self, num_layers: int, head_dim: int) -> None:
        """`check_layers`, and a q8 codec's blocks of 32 channels of one head: ConfigError unless head_dim is a
        multiple (a pod that could not encode would drop every write)."""
        self.check_layers(num_layers)
        if self.mode == "q8" and head_dim % Q8_BLOCK:
            raise ConfigError(f"codec q8 quantizes blocks of {Q8_BLOCK} channels of one head, but the model's head_dim "
                              f"is {head_dim}")

    @property
    def transform(self) -> int:
        """The frame's transform bits (format versions 2 and 3) for this spec; 0 for none."""
        v = self.variant or PLAIN
        return ((ROT_KEYS if v.rot_keys else 0) | (ROT_VALUES if v.rot_values else 0)
                | (LAYER_TABLE if self.hi != NO_HI else 0))

    def layer_table(self, layers: int) -> bytes:
        """The frame's layer table (format version 3) for KV of `layers` layers; empty when no layer is raised."""
        if self.hi == NO_HI:
            return b""
        bits, alt, hi = BITS[self.mode], ALT_BITS[self.mode], self.hi

        def of(i: int, at8: tuple[int, ...], other: tuple[int, ...]) -> int:
            return HI_BITS if i in at8 else alt if i in other else bits

        return bytes(of(i, hi.keys, hi.alt_keys) | of(i, hi.values, hi.alt_values) << 4 for i in range(layers))

    @property
    def lossless(self) -> bool:
        """Only `exact` is lossless for every input (`fp16` is, for fp16 input alone)."""
        return self.mode == "exact"


def _check_recent(mode: str, recent: str) -> None:
    """ConfigError unless `recent` ("" or a mode) may encode the partial last block of a `mode` codec: int8 under
    int4 and int2, or int4 under int2 (more bits than the blocks before it, never fewer)."""
    if recent and recent not in RECENT_MODES.get(mode, ()):
        allowed = "; ".join(f"{m}: {', '.join(r)}" for m, r in RECENT_MODES.items())
        raise ConfigError(f"/recent={recent} does not apply to {mode}: the partial block's mode takes more bits than "
                          f"the blocks' ({allowed})")


def _recent_text(recent: str) -> str:
    return f"/recent={recent}" if recent else ""


def recent_spec(spec: CodecSpec) -> CodecSpec:
    """The spec of a partial last block under `spec`: its /recent= mode with the same compressor (and, for int4 under
    int2, the same group and options, no layer table). A spec without /recent= is its own."""
    if not spec.recent:
        return spec
    if spec.recent in GROUPED_MODES:
        return replace(spec, mode=spec.recent, hi=NO_HI, recent="")
    return CodecSpec(mode=spec.recent, compressor=spec.compressor, level=spec.level)


def _parse_options(text: str, mode: str, names: list[str]) -> Variant | None:
    """The Variant named by "/rot/clip"-style options, or None (the mode's default) if none."""
    if not names:
        return None
    if mode not in GROUPED_MODES:
        raise ConfigError(f"bad codec spec {text!r}: options apply to int4/int2 only")
    unknown = [n for n in names if n not in _OPTIONS]
    if unknown or len(set(names)) != len(names) or ("plain" in names and len(names) > 1):
        raise ConfigError(f"bad codec spec {text!r}: options are {', '.join(_OPTIONS)}, each once, "
                          f"plain alone")
    picked = [_OPTIONS[n] for n in names]
    return Variant(*(any(field) for field in zip(*picked, strict=True)))


def _parse_layers(text: str, mode: str, layers: str | None) -> tuple[int, ...]:
    """The layer numbers of a "/k8=0.5.12" option, distinct; () if the option is absent."""
    if layers is None:
        return ()
    if mode not in GROUPED_MODES:
        raise ConfigError(f"bad codec spec {text!r}: int8 layers apply to int4/int2 only")
    numbers = [int(n) for n in layers.split(".")]
    if len(set(numbers)) != len(numbers):
        raise ConfigError(f"bad codec spec {text!r}: a layer is named twice")
    return tuple(numbers)


def _options_text(v: Variant) -> str:
    """The canonical option suffix of a Variant: "/rot/clip", "/rotv", "/plain" ..."""
    rot = {(True, True): "/rot", (True, False): "/rotk", (False, True): "/rotv"}
    text = rot.get((v.rot_keys, v.rot_values), "") + ("/clip" if v.clip else "")
    return text or "/plain"


def _offsets(sections: list[Section]) -> tuple[list[int], int]:
    """Byte offset of each section (aligned to 8) and the raw payload length."""
    offsets, end = [], 0
    for dtype, shape in sections:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + _nbytes(dtype, shape)
    return offsets, end


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


def _plan(h: FrameHeader) -> tuple[tuple[Section, ...], tuple[int, ...], int]:
    """The header's payload sections, their offsets and the raw length; computed once per kind of frame (a
    lookup opens hundreds of frames of one shape: this was a third of opening one)."""
    return _plan_of(h.mode, h.layers, h.kv_heads, h.tokens, h.head_dim, h.group_size, h.dtype, h.hi_counts)


@functools.lru_cache(maxsize=256)
def _plan_of(mode: str, layers: int, heads: int, tokens: int, dim: int, group: int, dtype: str,
             hi_counts: tuple[int, ...]) -> tuple[tuple[Section, ...], tuple[int, ...], int]:
    sections = layout(mode, Dims(layers, heads, tokens, dim), group if mode in GROUPED_MODES else 0,
                      _DTYPES[dtype], hi_counts)
    offsets, raw_len = _offsets(sections)
    return tuple(sections), tuple(offsets), raw_len


def _hi_of(h: FrameHeader) -> HiLayers:
    if not h.layer_bits:
        return NO_HI
    alt = ALT_BITS[h.mode]
    return HiLayers(h.hi_layers(0), h.hi_layers(1), h.hi_layers(0, alt), h.hi_layers(1, alt))


def _all_layers(hi: HiLayers) -> tuple[int, ...]:
    return (*hi.keys, *hi.values, *hi.alt_keys, *hi.alt_values)


def _itemsize(mode: str, dtype: torch.dtype) -> int:
    return dtype.itemsize if mode == "exact" else 2


def _as_bytes(frame: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise CodecError(f"a frame is bytes, bytearray or memoryview, not {type(frame).__name__}")
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def read_header(frame: bytes | bytearray | memoryview, *,
                max_elements: int = DEFAULT_MAX_ELEMENTS) -> FrameHeader:
    """Parse and validate the header alone: fields, limits and the declared raw length."""
    try:
        header = parse_header(_as_bytes(frame), max_elements=max_elements)
        raw_len = _plan(header)[2]
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
    view = _as_bytes(frame)
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
    """`verify_frame` of a frame received apart (`cachestore.landing.Scatter`): its header, and its payload in
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


class Codec:
    """Encodes KV tensors with one spec; decodes frames of any spec."""

    def __init__(self, spec: CodecSpec | str = CodecSpec()) -> None:
        self.spec = CodecSpec.parse(spec) if isinstance(spec, str) else spec

    def __repr__(self) -> str:
        return f"Codec({self.spec.name()!r})"

    def encode(self, kv: torch.Tensor) -> bytes:
        """kv [layers, 2, kv_heads, tokens, head_dim] (fp32/fp16/bf16, any device) -> frame."""
        dims, dtype = _check_input(kv)
        spec = self.spec
        group = spec.group_size if spec.mode in GROUPED_MODES else 0
        sections = layout(spec.mode, dims, group, dtype, spec.hi.counts)
        parts = quantize(spec.mode, kv.detach(), group, spec.variant or PLAIN, spec.hi)
        offsets, raw_len = _offsets(sections)
        raw = torch.zeros(raw_len, dtype=torch.uint8)
        for (sec_dtype, shape), part, start in zip(sections, parts, offsets, strict=True):
            assert part.dtype == sec_dtype and tuple(part.shape) == shape, (part.shape, shape)
            if spec.rows and spec.mode in FLOAT_MODES:  # [layers, 2, tokens, kv_heads, head_dim]: K and V as token rows
                part = part.transpose(2, 3)
            raw[start:start + part.numel() * part.element_size()] = (
                part.contiguous().view(-1).view(torch.uint8))  # copies device -> cpu if needed
        comp, shuffled = spec.compressor, spec.mode in FLOAT_MODES and spec.compressor == "zstd"
        packed = shuffle(raw, _itemsize(spec.mode, dtype)) if shuffled else raw
        payload = compress(memoryview(packed.numpy()), comp, spec.level)  # type: ignore[arg-type]
        if comp != "none" and len(payload) > raw_len * _WORTH:
            # Incompressible (int8 and fp16 KV under lz4): store it plainly, so decoding
            # skips a decompression that would buy nothing. The frame says so itself.
            comp, shuffled, payload = "none", False, bytes(memoryview(raw.numpy()))  # type: ignore[arg-type]
        # The oldest version that holds the frame (1: nothing transformed, 2: rotations, 3: a layer
        # table): older readers keep reading the frames they can.
        table = spec.layer_table(dims.layers)
        version = 3 if table else 2 if spec.transform else 1
        stored = table + payload
        flags = (FLAG_SHUFFLE if shuffled else 0) | (FLAG_ROWS if spec.rows else 0)
        header = FrameHeader(version, spec.mode, comp, _DTYPE_NAMES[dtype], flags, group, dims.layers, dims.heads,
                             dims.tokens, dims.head_dim, raw_len, len(stored), 0, spec.transform, table)
        digest = checksum(pack_header(header), stored)
        return pack_header(replace(header, checksum=digest)) + stored

    def plain_size(self, kv_shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> int:
        """The length of this spec's frame of KV [layers, 2, kv_heads, tokens, head_dim] in `dtype` when stored
        plainly (uncompressed; lz4 leaves int8 and fp16 KV so): a lookup reads frames of this length in place."""
        layers, _, heads, tokens, dim = kv_shape
        spec = self.spec
        _, _, raw_len = _plan_of(spec.mode, layers, heads, tokens, dim,
                                 spec.group_size if spec.mode in GROUPED_MODES else 0, _DTYPE_NAMES[dtype],
                                 spec.hi.counts)
        return HEADER_SIZE + len(spec.layer_table(layers)) + raw_len

    def decode(self, frame: bytes | bytearray | memoryview, *,
               device: torch.device | str | None = None,
               max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
        """A frame of any mode -> kv [layers, 2, kv_heads, tokens, head_dim] in its original
        dtype on `device` (default cpu). Raises only CodecError."""
        return _codec_errors_only(lambda: _decode(_as_bytes(frame), device, max_elements))

    def open(self, frame: bytes | bytearray | memoryview, *,
             max_elements: int = DEFAULT_MAX_ELEMENTS) -> OpenFrame:
        """Verify and decompress a frame of any mode, leaving the dequantization for later
        (`OpenFrame.decode_into`, possibly a few layers at a time). Raises only CodecError."""
        return _codec_errors_only(lambda: _open(_as_bytes(frame), None, max_elements))

    def decode_into(self, frame: bytes | bytearray | memoryview, out: torch.Tensor, *,
                    max_elements: int = DEFAULT_MAX_ELEMENTS) -> torch.Tensor:
        """Decode a frame of any mode straight into `out` [layers, 2, kv_heads, tokens, head_dim]
        (any float dtype and device, a strided view such as a slice of a larger context is fine);
        returns `out`. A frame whose shape differs from out's raises CodecError, out untouched."""
        return _codec_errors_only(lambda: _decode(_as_bytes(frame), out.device, max_elements, out))


def _codec_errors_only(decode: Callable[[], T]) -> T:
    """Run a decoding step over untrusted bytes: a frame must never raise anything but CodecError."""
    try:
        return decode()
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc


def _check_input(kv: torch.Tensor) -> tuple[Dims, torch.dtype]:
    if not isinstance(kv, torch.Tensor):
        raise CodecError(f"encode takes a torch.Tensor, not {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise CodecError(f"KV must be [layers, 2, kv_heads, tokens, head_dim], got "
                         f"{list(kv.shape)}")
    if kv.dtype not in _DTYPE_NAMES:
        raise CodecError(f"KV dtype {kv.dtype} is not float32, float16 or bfloat16")
    n_layers, _, heads, tokens, dim = kv.shape
    for name, value, limit in (("layers", n_layers, MAX_DIM), ("kv_heads", heads, MAX_DIM),
                               ("tokens", tokens, MAX_TOKENS), ("head_dim", dim, MAX_DIM)):
        if not 1 <= value < limit:
            raise CodecError(f"KV {name} = {value} outside 1..{limit - 1}")
    return Dims(n_layers, heads, tokens, dim), kv.dtype


def _borrow(payload: memoryview, raw_len: int) -> torch.Tensor:
    """A uint8 tensor over the caller's (possibly read-only) bytes, without a copy.

    Nothing writes to it: dequantizing reads these sections once and writes new tensors, and a
    float frame decoded without an output is copied out of it (`OpenFrame.decode_into`).
    """
    if len(payload) != raw_len:
        raise CodecError(f"payload is {len(payload)} bytes, header says {raw_len}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(payload, dtype=torch.uint8)


def _decode(view: memoryview, device: torch.device | str | None,
            max_elements: int, out: torch.Tensor | None = None) -> torch.Tensor:
    return _open(view, device, max_elements).decode_into(out)


def _open(view: memoryview, device: torch.device | str | None, max_elements: int) -> OpenFrame:
    header = verify_frame(view, max_elements=max_elements)
    payload = view[HEADER_SIZE + header.table_len:]
    borrowed = header.compressor == "none"
    if borrowed:  # read in place: an fp16 context of 2048 SmolLM2 tokens would be a 47 MB copy
        buf = _borrow(payload, header.raw_len)
    else:
        raw = decompress(payload, header.compressor, header.raw_len)
        buf = torch.frombuffer(raw, dtype=torch.uint8)  # shares raw, which it keeps alive
    if header.shuffled:
        buf = unshuffle(buf, _itemsize(header.mode, _DTYPES[header.dtype]))
    target = torch.device(device) if device is not None else torch.device("cpu")
    frame = OpenFrame(header, buf, borrowed and target.type == "cpu", target)  # parts moved to a device are copies
    if target.type != "cpu":
        _ = frame.parts  # moved now: a frame opened for a device is whole there
    return frame


@dataclass(frozen=True)
class OpenFrame:
    """A frame already verified and decompressed: dequantizing it cannot fail, and it can be done
    a few layers at a time (the pod hands layers to the forward step as they are ready)."""

    header: FrameHeader
    raw: torch.Tensor  # the raw payload, uint8 on the CPU
    borrowed: bool = False  # `raw` is the caller's (read-only) frame bytes: never handed out as they are
    device: torch.device = torch.device("cpu")

    @functools.cached_property
    def parts(self) -> list[torch.Tensor]:
        """The payload sections of quant.layout (layers first), views of `raw` (copies on another device); made on
        first use: a frame dequantized from its lookup's landing (`FrameRun`) never needs them."""
        sections, offsets, _ = _plan(self.header)
        parts = []
        for (sec_dtype, shape), start in zip(sections, offsets, strict=True):
            part = self.raw[start:start + _nbytes(sec_dtype, shape)].view(sec_dtype)
            rows = self.header.rows and len(shape) == 5  # q8's one flat section is rows already
            parts.append(part.view(_stored(shape)).transpose(2, 3) if rows else part.view(shape))
        return parts if self.device.type == "cpu" else [part.to(self.device) for part in parts]

    @property
    def kind(self) -> tuple[object, ...]:
        """Every field of the header but its checksum: frames of one kind share their layout (`FrameRun`)."""
        return _kind(self.header)

    @property
    def splits_by_layer(self) -> bool:
        """Whether `decode_into` takes a part of the layers (packed codes of odd shapes do not)."""
        h = self.header
        if h.layer_bits:  # each layer's codes are padded to a byte in frames with a layer table
            return True
        return codes_split_by_layer(h.mode, Dims(h.layers, h.kv_heads, h.tokens, h.head_dim), h.group_size)

    def decode_into(self, out: torch.Tensor | None = None, layers: slice | None = None) -> torch.Tensor:
        """Dequantize layers `layers` (all by default) into `out` [those layers, 2, kv_heads, tokens,
        head_dim] (any float dtype, a strided view is fine), or into a new tensor of the frame's dtype.
        An output of another shape raises CodecError and is left untouched."""
        h = self.header
        first, stop, _ = (layers or slice(None)).indices(h.layers)
        count = max(0, stop - first)
        dims = Dims(count, h.kv_heads, h.tokens, h.head_dim)
        shape = [count, 2, h.kv_heads, h.tokens, h.head_dim]
        if out is not None and (list(out.shape) != shape or not out.dtype.is_floating_point):
            raise CodecError(f"frame holds {shape}, the output is {list(out.shape)} {out.dtype}")
        variant = Variant(rot_keys=bool(h.transform & ROT_KEYS), rot_values=bool(h.transform & ROT_VALUES))
        if out is None and (self.borrowed or h.rows) and h.mode in FLOAT_MODES:  # else it would alias the frame
            out = torch.empty(shape, dtype=_DTYPES[h.dtype], device=self.parts[0].device)
        if h.layer_bits:
            if out is None:
                out = torch.empty(shape, dtype=_DTYPES[h.dtype], device=self.parts[0].device)
            full = Dims(h.layers, h.kv_heads, h.tokens, h.head_dim)
            return dequantize_mixed(h.mode, self.parts, full, h.group_size, out, variant, _hi_of(h), first)
        if count != h.layers:
            if not codes_split_by_layer(h.mode, dims, h.group_size):
                raise CodecError("this frame's packed codes cannot be split by layer")
            parts = [_layer_slice(p, first, count, h.layers) for p in self.parts]
        else:
            parts = self.parts
        return dequantize(h.mode, parts, dims, h.group_size, _DTYPES[h.dtype], out, variant)


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

    def decode_into(self, out: torch.Tensor | None = None, layers: slice | None = None) -> torch.Tensor:
        first, stop, _ = (layers or slice(None)).indices(self.header.layers)
        h = self.header
        shape = [max(0, stop - first), 2, h.kv_heads, h.tokens, h.head_dim]
        if (out is None or list(out.shape) != shape or out.dtype != _DTYPES[h.dtype] or not shape[0]
                or (self.at and out.data_ptr() != self.at + first * self.layer_stride)):
            raise CodecError("a placed frame's rows lie where they were received; this output is elsewhere")
        return out


class FrameRun:
    """Frames of one kind lying at one stride in one buffer (a lookup's landing, `cachestore.landing`): one layer
    of all of them is dequantized in a single call, straight from the buffer.

    Dequantizing frame after frame writes the whole context before the first layer's attention, and the context
    is larger than the caches (94 MB at 2048 SmolLM2 tokens in fp32): the forward step then reads it back from
    memory. Layer by layer, each layer's KV is written just before its attention reads it, while it is still
    cached; with one call per layer per run instead of one per frame.
    """

    def __init__(self, header: FrameHeader, count: int, stride: int, typed: dict[torch.dtype, torch.Tensor],
                 starts: list[int]) -> None:
        self.header, self.count = header, count
        self._stride = stride  # bytes from one frame to the next
        self._typed = typed  # the buffer viewed as each section's dtype
        self._starts = starts  # each section's first element in frame 0, in its dtype's view of the buffer

    @classmethod
    def of(cls, buffer: torch.Tensor, frames: list[OpenFrame]) -> FrameRun | None:
        """`frames` as one run over `buffer` (1-D uint8), or None unless each is read in place from it, all at one
        stride, of one kind (mode, shape, dtype, group, transform; no layer table, codes that split by layer)."""
        if not frames or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            return None
        first = frames[0]
        h = first.header
        kind = _kind(h)
        if (h.layer_bits or h.rows or not first.splits_by_layer
                or any(not f.borrowed or _kind(f.header) != kind for f in frames)):
            return None
        base, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
        origins = [f.raw.data_ptr() for f in frames]
        stride = origins[1] - origins[0] if len(frames) > 1 else 0
        if (any(o != origins[0] + k * stride for k, o in enumerate(origins)) or origins[0] < base
                or origins[-1] + h.raw_len > end):
            return None
        sections, offsets, _ = _plan(h)
        typed: dict[torch.dtype, torch.Tensor] = {}
        starts = []
        for (dtype, _), offset in zip(sections, offsets, strict=True):
            size = dtype.itemsize
            at = origins[0] - base + offset
            if at % size or stride % size:
                return None
            if dtype not in typed:
                typed[dtype] = buffer[: buffer.numel() - buffer.numel() % size].view(dtype)
            starts.append(at // size)
        return cls(h, len(frames), stride, typed, starts)

    @property
    def decodes_whole(self) -> bool:
        """Whether `decode_into` takes a call for all the keys and one for all the values (int8); any other kind takes
        one a layer, more calls than decoding its frames one by one."""
        return self.header.mode == "int8" and not self.header.transform

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Every layer of every frame into `out` [layers, 2, kv_heads, frames * tokens, head_dim] (a strided view of a
        context is fine; frame k's tokens at out[:, :, :, k * tokens:(k + 1) * tokens]); returns `out`. int8 takes a
        call for all the keys and one for all the values (into a llama.cpp sequence state's rows: one kernel pass
        each), any other kind a call a layer. An output of another shape raises CodecError and is left untouched."""
        h, n = self.header, self.count
        shape = [h.layers, 2, h.kv_heads, n * h.tokens, h.head_dim]
        if list(out.shape) != shape or not out.dtype.is_floating_point:
            raise CodecError(f"a run of {n} frames holds {shape}, the output is {list(out.shape)} {out.dtype}")
        framed = out.unflatten(3, (n, h.tokens)).permute(0, 3, 1, 2, 4, 5)  # [layers, frames, 2, heads, tokens, dim]
        if self.decodes_whole:
            sk, sv, qk, qv = self._parts(None)  # [layers, frames, ...] each
            int8_codes_into(framed[:, :, 0], qk, sk)
            int8_codes_into(framed[:, :, 1], qv, sv)
            return out
        for layer in range(h.layers):
            self.decode_layer_into(framed[layer], layer)
        return out

    def decode_layer_into(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer` of every frame into `out` [frames, 2, kv_heads, tokens, head_dim] (a strided view of a
        context is fine; frame k's tokens at out[k]); returns `out`."""
        h, n = self.header, self.count
        variant = Variant(rot_keys=bool(h.transform & ROT_KEYS), rot_values=bool(h.transform & ROT_VALUES))
        parts = [part if part.dtype != torch.uint8 else part.reshape(-1) for part in self.layer_parts(layer)]
        return dequantize(h.mode, parts, Dims(n, h.kv_heads, h.tokens, h.head_dim), h.group_size, _DTYPES[h.dtype],
                          out, variant)

    def layer_parts(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s payload sections of every frame, as strided views of the buffer, frames first (the
        shapes of `cachestore.quant.layout` less its layers; packed codes [frames, a layer's bytes]): int8's are key
        scales [frames, kv_heads, 1, head_dim], value scales [frames, kv_heads, tokens, 1], then the key and the
        value codes [frames, kv_heads, tokens, head_dim]."""
        return self._parts(layer)

    def _parts(self, layer: int | None) -> list[torch.Tensor]:
        """`layer_parts`, or with `layer` None every layer's, layers first ([layers, frames, ...]; sections of
        packed codes are not split by layer then: [frames, all their bytes])."""
        n, layers = self.count, self.header.layers
        parts = []
        for (dtype, shape), start in zip(_plan(self.header)[0], self._starts, strict=True):
            typed, step = self._typed[dtype], self._stride // dtype.itemsize
            if len(shape) > 1:  # layers first: frame k's layer is one contiguous block, `step` after frame k-1's
                inner = shape[1:]
                strides: list[int] = []
                acc = 1
                for size in reversed(inner):
                    strides.insert(0, acc)
                    acc *= size
                if layer is None:
                    parts.append(typed.as_strided((layers, n, *inner), (acc, step, *strides), start))
                else:
                    parts.append(typed.as_strided((n, *inner), (step, *strides), start + layer * acc))
            else:  # packed codes, layer-major, each layer's on whole bytes (splits_by_layer)
                per = shape[0] // layers if layer is not None else shape[0]
                parts.append(typed.as_strided((n, per), (step, 1), start + (layer or 0) * per))
        return parts


def _stored(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A float section's shape as a FLAG_ROWS payload stores it: [layers, 2, tokens, kv_heads, head_dim]."""
    layers, two, heads, tokens, dim = shape
    return (layers, two, tokens, heads, dim)


def _kind(h: FrameHeader) -> tuple[object, ...]:
    """Every field of a header but its checksum: frames of one kind share their layout."""
    return (h.version, h.mode, h.compressor, h.dtype, h.flags, h.group_size, h.layers, h.kv_heads, h.tokens,
            h.head_dim, h.raw_len, h.payload_len, h.transform, h.layer_bits)


def _layer_slice(part: torch.Tensor, first: int, count: int, layers: int) -> torch.Tensor:
    """Layers [first, first + count) of a payload section: a leading-dim slice, or for the packed
    int4/int2 codes (flat bytes, layer-major, each layer's codes starting on a byte) those layers' bytes."""
    if part.dim() > 1:
        return part[first:first + count]
    per_layer = part.numel() // layers
    return part[first * per_layer:(first + count) * per_layer]
