"""The codec spec grammar, "MODE[+COMPRESSOR[:LEVEL]][/gGROUP][/OPTION...][/kU=L.L...][/vU=L.L...][/recent=MODE]",
and what each part means (`GRAMMAR`, `OPTIONS`: docs/codec-spec.md is generated from them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from cachestore.codec.frame import (
    COMPRESSORS,
    FLOAT_MODES,
    GROUPED_MODES,
    KEY_CLASS_BITS,
    KEY_CLASSES,
    LAYER_TABLE,
    MAX_DIM,
    MAX_GROUP,
    MIN_GROUP,
    MODES,
    OUTLIER_KEYS,
    OUTLIER_SHARE,
    ROT_VALUES,
    ROWS_MODES,
    SCALE8,
    SYM_VALUES,
    UNROPE,
    UP_BITS,
    key_classes_fit,
    outlier_fits,
)
from cachestore.codec.frame import MODE_BITS as BITS
from cachestore.codec.layout import NO_HI, PLAIN, HiLayers, Variant
from cachestore.codec.q8 import Q8_BLOCK
from cachestore.errors import ConfigError

DEFAULT_GROUP = 64  # measured against 32 on SmolLM2 KV: see ops/bench/codec.py --groups
GRAMMAR = "MODE[+COMPRESSOR[:LEVEL]][/gGROUP][/OPTION...][/kU=L.L...][/vU=L.L...][/recent=MODE]"
# each part of GRAMMAR, in its order, and what it means (docs/codec-spec.md)
PARTS = {
    "MODE": "exact, fp16, int8, q8, int4 or int2 (their loss: `cachestore/codec/codec.py`)",
    "+COMPRESSOR[:LEVEL]": "lz4 (the default), zstd (level 1-22, 3 by default) or none",
    "/gGROUP": f"int4/int2: the tokens (keys) or channels (values) one range covers, {MIN_GROUP}-{MAX_GROUP}, "
               f"{DEFAULT_GROUP} by default",
    "/OPTION": "int4/int2: the options below, each once, in any order (a bare int4 or int2 takes its "
               "`DEFAULT_VARIANTS`); /rows, last: exact/fp16 payloads as token rows, a llama.cpp state's layout "
               "(q8's always are)",
    "/kU=L.L...": "with /s8: the layers whose keys take one bit more than the mode, U = 5 in int4, 3 in int2 (not "
                  "with /kbits); layers of one model, found with `kvstash bench layers`",
    "/vU=L.L...": "the same for values",
    "/recent=MODE": "int4/int2: the mode of a sequence's partial last block (its most recent tokens): int8, or int4 "
                    "under int2",
}
_LAYERS = r"\d{1,5}(?:\.\d{1,5})*"
_SPEC = re.compile(r"(?P<mode>[a-z0-9]+)(?:\+(?P<comp>[a-z0-9]+)(?::(?P<level>-?\d+))?)?"
                   r"(?:/g(?P<group>\d+))?(?P<options>(?:/[a-z][a-z0-9]*)*)"
                   rf"(?:/k(?P<ku_bits>[35])=(?P<ku>{_LAYERS}))?(?:/v(?P<vu_bits>[35])=(?P<vu>{_LAYERS}))?"
                   r"(?:/recent=(?P<recent>[a-z0-9]+))?")
# int4/int2 options as spec text, in their canonical order, with what each does (docs/codec-spec.md)
OPTIONS: dict[str, tuple[Variant, str]] = {
    "plain": (PLAIN, "none of the others (alone): the original KIVI-style codec, frame format 1"),
    "rotv": (Variant(rot_values=True), "values multiplied by a block-Hadamard matrix along head_dim before "
                                       "quantizing, which spreads outlier channels over the head (format 2)"),
    "clip": (Variant(clip=True), "the encoder shrinks each group's range where that lowers its squared error; "
                                 "decoders need not know"),
    "outk": (Variant(outlier_keys=True), "each key group's widest channels (1 in 8 in int2, 1 in 16 in int4) at "
                                         "int4 / int8; with /s8"),
    "kbits": (Variant(key_classes=True), "each key channel of a group its bits by importance, in fixed counts "
                                         "(int2: 0, 2, 3 or 4 bits, int4: 3, 4, 5 or 6); with /s8, not with /outk"),
    "symv": (Variant(sym_values=True), "values quantized about zero: a scale and no zero point a group; with /s8"),
    "s8": (Variant(scale8=True), "every group's range as two 8-bit codes between its block's extremes, a quarter "
                                 "bit a value less (format 5); with one of /outk, /kbits, /symv"),
    "unrope": (Variant(unrope=True), "keys stored with RoPE undone relative to their block's first token (the "
                                     "engine declares its RoPE; format 6); with /s8 and one of /outk, /kbits, /symv"),
}
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

    mode: str = "int8"  # "exact" | "fp16" | "int8" | "int4" | "int2" | "q8"
    compressor: str = "lz4"  # "zstd" | "lz4" | "none"
    level: int = 3  # zstd level, 1..22
    group_size: int = DEFAULT_GROUP  # int4/int2 group size
    variant: Variant | None = None  # int4/int2 options; None: DEFAULT_VARIANTS of the mode
    hi: HiLayers = NO_HI  # int4/int2 with a split layout: layers whose keys / values take one bit more (UP_BITS)
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
        if any(not 0 <= layer < MAX_DIM for layer in (*self.hi.up_keys, *self.hi.up_values)):
            raise ConfigError(f"per-layer bits {self.hi} outside layers 0..{MAX_DIM - 1}")
        object.__setattr__(self, "hi", HiLayers(*(tuple(sorted(set(h))) for h in self.hi)))
        if self.mode not in GROUPED_MODES:
            object.__setattr__(self, "group_size", DEFAULT_GROUP)
            object.__setattr__(self, "variant", PLAIN)
            object.__setattr__(self, "hi", NO_HI)
        elif self.variant is None:
            object.__setattr__(self, "variant", DEFAULT_VARIANTS[self.mode])
        _check_options(self.mode, self.variant or PLAIN, self.hi)
        _check_recent(self.mode, self.recent)

    @classmethod
    def parse(cls, text: str) -> CodecSpec:
        """Parse a spec of `GRAMMAR`, e.g. "int8", "int4+zstd:3/g32", "int2/g32/rotv/clip", "fp16+none/rows",
        "int4+zstd/kbits/s8/unrope/v5=11.15/recent=int8" (docs/codec-spec.md)."""
        match = _SPEC.fullmatch(text.strip().lower()) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(f"bad codec spec {text!r}; expected {GRAMMAR} (docs/codec-spec.md)")
        mode, comp = match["mode"], match["comp"] or "lz4"
        if match["level"] is not None and comp != "zstd":
            raise ConfigError(f"bad codec spec {text!r}: a level applies to zstd only")
        if match["group"] is not None and mode not in GROUPED_MODES:
            raise ConfigError(f"bad codec spec {text!r}: a group size applies to int4/int2 only")
        level = int(match["level"]) if match["level"] is not None else 3
        group = int(match["group"]) if match["group"] is not None else DEFAULT_GROUP
        for name in ("ku_bits", "vu_bits"):
            if match[name] is not None and (mode not in UP_BITS or int(match[name]) != UP_BITS[mode]):
                raise ConfigError(f"bad codec spec {text!r}: /{name[0]}{match[name]}= applies to "
                                  f"{'int4' if match[name] == '5' else 'int2'} only (one bit more than the mode)")
        hi = HiLayers(*(_parse_layers(text, mode, match[name]) for name in ("ku", "vu")))
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
            v = self.variant or PLAIN
            text += f"/g{self.group_size}" + ("".join(f"/{o}" for o, (bit, _) in OPTIONS.items()
                                                      if bit != PLAIN and any(v[i] for i, b in enumerate(bit) if b))
                                              or "/plain")
            for half, layers in zip("kv", self.hi, strict=True):
                if layers:
                    text += f"/{half}{UP_BITS[self.mode]}=" + ".".join(map(str, layers))
        return text + ("/rows" if self.rows and self.mode in FLOAT_MODES else "") + _recent_text(self.recent)

    def check_layers(self, num_layers: int) -> None:
        """ConfigError unless every layer the spec gives one bit more exists in a model of `num_layers` layers (they
        are one model's calibration: a pod whose model lacks them would drop every write)."""
        beyond = [n for n in (*self.hi.up_keys, *self.hi.up_values) if n >= num_layers]
        if beyond:
            raise ConfigError(f"codec {self.name()} gives layer {max(beyond)} {UP_BITS[self.mode]} bits, but the "
                              f"model has layers 0-{num_layers - 1}: /k{UP_BITS[self.mode]}= and "
                              f"/v{UP_BITS[self.mode]}= name one model's layers")

    def check_model(self, num_layers: int, head_dim: int) -> None:
        """`check_layers`, and a q8 codec's blocks of 32 channels of one head: ConfigError unless head_dim is a
        multiple (a pod that could not encode would drop every write)."""
        self.check_layers(num_layers)
        v = self.variant or PLAIN
        if v.key_classes and not key_classes_fit(self.mode, head_dim):
            raise ConfigError(f"codec {self.name()} sets the bits of each key channel in groups of 64, which needs a "
                              f"head_dim that is a multiple of 64, not {head_dim}")
        if v.outlier_keys and not outlier_fits(self.mode, head_dim):
            share = OUTLIER_SHARE[self.mode]
            raise ConfigError(f"codec {self.name()} keeps 1 key channel in {share} apart, which needs a head_dim that "
                              f"is a multiple of {share}, not {head_dim}")
        if self.mode == "q8" and head_dim % Q8_BLOCK:
            raise ConfigError(f"codec q8 quantizes blocks of {Q8_BLOCK} channels of one head, but the model's head_dim "
                              f"is {head_dim}")

    @property
    def transform(self) -> int:
        """The frame's transform bits for this spec; 0 for none."""
        v = self.variant or PLAIN
        return ((ROT_VALUES if v.rot_values else 0) | (LAYER_TABLE if self.hi != NO_HI else 0)
                | (OUTLIER_KEYS if v.outlier_keys else 0) | (SYM_VALUES if v.sym_values else 0)
                | (SCALE8 if v.scale8 else 0) | (KEY_CLASSES if v.key_classes else 0) | (UNROPE if v.unrope else 0))

    def layer_table(self, layers: int) -> bytes:
        """The frame's layer table for KV of `layers` layers; empty when no layer is raised."""
        if self.hi == NO_HI:
            return b""
        bits, up = BITS[self.mode], UP_BITS[self.mode]
        return bytes((up if i in self.hi.up_keys else bits) | (up if i in self.hi.up_values else bits) << 4
                     for i in range(layers))

    @property
    def lossless(self) -> bool:
        """Only `exact` is lossless for every input (`fp16` is, for fp16 input alone)."""
        return self.mode == "exact"


def _check_options(mode: str, v: Variant, hi: HiLayers) -> None:
    """ConfigError unless the options come as a frame format holds them: the split options with /s8 and /s8 with one
    of them, per-layer bits with them, /kbits and /unrope as format 6 holds them."""
    if v.unrope and not (v.split and v.scale8):
        raise ConfigError("/unrope (keys stored without their RoPE) takes /s8 and one of /kbits, /outk, /symv")
    if v.key_classes and (mode not in KEY_CLASS_BITS or v.outlier_keys or hi.up_keys or not v.scale8):
        raise ConfigError("/kbits applies to int4 and int2 with /s8, without /outk or a key layer one bit more (/k3=, "
                          "/k5=: it sets every key channel's bits itself)")
    if v.split != v.scale8 or (hi != NO_HI and not v.split):
        raise ConfigError("/outk, /kbits and /symv take /s8, and /s8 and per-layer bits (/k5=, /v5= in int4, /k3=, "
                          "/v3= in int2) take one of them")


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
    if spec.recent in GROUPED_MODES:  # int4 under int2: its outlier channels where int2 has key classes
        v = spec.variant or PLAIN
        if v.key_classes:
            v = v._replace(key_classes=False, outlier_keys=True)
        return replace(spec, mode=spec.recent, hi=NO_HI, recent="", variant=v)
    return CodecSpec(mode=spec.recent, compressor=spec.compressor, level=spec.level)


def _parse_options(text: str, mode: str, names: list[str]) -> Variant | None:
    """The Variant named by "/rotv/clip"-style options, or None (the mode's default) if none."""
    if not names:
        return None
    if mode not in GROUPED_MODES:
        raise ConfigError(f"bad codec spec {text!r}: options apply to int4/int2 only")
    unknown = [n for n in names if n not in OPTIONS]
    if unknown or len(set(names)) != len(names) or ("plain" in names and len(names) > 1):
        raise ConfigError(f"bad codec spec {text!r}: options are {', '.join(OPTIONS)}, each once, plain alone "
                          f"(docs/codec-spec.md)")
    picked = [OPTIONS[n][0] for n in names]
    return Variant(*(any(field) for field in zip(*picked, strict=True)))


def _parse_layers(text: str, mode: str, layers: str | None) -> tuple[int, ...]:
    """The layer numbers of a "/v5=0.5.12" option, distinct; () if the option is absent."""
    if layers is None:
        return ()
    numbers = [int(n) for n in layers.split(".")]
    if len(set(numbers)) != len(numbers):
        raise ConfigError(f"bad codec spec {text!r}: a layer is named twice")
    return tuple(numbers)
