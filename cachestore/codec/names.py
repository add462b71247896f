"""What `int4` and `int2` mean for one model: the recommended codec of their size, with that model's per-layer bits.

A name is what a user writes; the spec it stands for is a codec plan's, made once per model and shared by a fleet
(`cachestore.codecplans`). For each mode the recommended options come first (docs/fidelity.md: `S8I4K7`, `S8I2V`
where the engine declares the model's RoPE; `S8I4K7N`, `S8I2R` where it declares none), then a fallback for a head
width they cannot take (`/kbits` sets key bits in groups of 64 channels). A share of the layers takes one bit
more in its keys or values: SmolLM2-135M's published tables where the weights are its own, otherwise the layers
where that bit removes the most squared error from the KV of a calibration text (a proxy: it does not see how the
model uses the error, and on SmolLM2 it is no substitute for `kvstash bench layers`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from cachestore.codec.arrays import Array, contiguous, namespace
from cachestore.codec.blockcodec import BlockCodecs
from cachestore.codec.frame import MODE_BITS, UP_BITS
from cachestore.codec.rope import Rope
from cachestore.codec.spec import CodecSpec
from cachestore.errors import ConfigError, KvstashError

NAMED = ("int4", "int2")  # names whose spec depends on the model; every other name or spec means itself
RECENT = {"int4": "int8", "int2": "int4"}  # the partial last block's mode (/recent=)
PLAN_VERSION = 1
MAX_PLAN_BYTES = 4096
# (mode, RoPE declared) -> candidates, best first: (options, share of key layers, share of value layers one bit up);
# the last, the mode's own default with no layer table, for a model none of the others can encode
CHOICES: Mapping[tuple[str, bool], tuple[tuple[str, float, float], ...]] = {
    ("int4", True): (("int4+zstd/kbits/s8/unrope", 0.0, 0.2), ("int4+zstd/outk/symv/s8", 0.0, 0.2),
                     ("int4+zstd", 0.0, 0.0)),
    ("int4", False): (("int4+zstd/kbits/s8", 0.0, 0.2), ("int4+zstd/outk/symv/s8", 0.0, 0.2), ("int4+zstd", 0.0, 0.0)),
    ("int2", True): (("int2+zstd:16/rotv/clip/kbits/symv/s8/unrope", 0.0, 0.2),
                     ("int2+zstd:16/rotv/clip/outk/symv/s8", 0.2, 0.1), ("int2+zstd:16", 0.0, 0.0)),
    ("int2", False): (("int2+zstd:16/rotv/clip/outk/symv/s8", 0.2, 0.1), ("int2+zstd:16", 0.0, 0.0)),
}
# SmolLM2-135M-Instruct's published tables (docs/fidelity.md), by weights digest: the GGUF the llama.cpp engines
# load, and the safetensors copy the hf engine converts from it
_SMOLLM2 = {("int4", True): ((), (11, 15, 17, 18, 23, 25)), ("int4", False): ((), (11, 15, 17, 18, 23, 25)),
            ("int2", True): ((), (0, 1, 18, 20, 23, 24)), ("int2", False): ((1, 2, 15, 17, 20, 23), (0, 1, 20))}
KNOWN = {"b2:0fbc0a3ee43fcb3fecaf5c9c824c50ef": ("SmolLM2-135M-Instruct", _SMOLLM2),
         "b2:23bdfef364db364571c4a2f62cfbebc6": ("SmolLM2-135M-Instruct", _SMOLLM2)}
SINK_TOKENS = 64  # the first block is stored at int8 whatever the codec (the attention sink): not calibrated on


@dataclass(frozen=True)
class CodecPlan:
    """One model's codecs by name: each NAMED name's spec, for a model of `layers` layers, and how it was chosen."""

    layers: int
    rope: bool  # whether the engine declares the model's RoPE
    specs: Mapping[str, str] = field(default_factory=dict)  # name -> canonical spec
    source: str = ""  # "published: <model>" or "kv statistics: <n> calibration tokens"
    made_by: str = ""  # the pod that made it

    def __post_init__(self) -> None:  # canonical specs: the plan a pod makes equals the one it reads back
        object.__setattr__(self, "specs", {name: CodecSpec.parse(text).name() for name, text in self.specs.items()})

    def to_json(self) -> bytes:
        return json.dumps({"version": PLAN_VERSION, "layers": self.layers, "rope": self.rope,
                           "specs": dict(self.specs), "source": self.source, "made_by": self.made_by},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CodecPlan:
        """A plan read back from Redis (untrusted); ConfigError unless every field is as `to_json` writes it and
        every spec parses."""
        if len(raw) > MAX_PLAN_BYTES:
            raise ConfigError(f"a codec plan of {len(raw)} bytes (at most {MAX_PLAN_BYTES})")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"a codec plan that is not JSON: {exc}") from None
        if (not isinstance(data, dict) or data.get("version") != PLAN_VERSION
                or not isinstance(data.get("layers"), int) or not isinstance(data.get("rope"), bool)
                or not isinstance(data.get("specs"), dict) or set(data["specs"]) != set(NAMED)
                or not all(isinstance(s, str) for s in data["specs"].values())
                or not isinstance(data.get("source"), str) or not isinstance(data.get("made_by"), str)):
            raise ConfigError(f"a codec plan not of version {PLAN_VERSION}'s shape")
        return cls(data["layers"], data["rope"], data["specs"], data["source"], data["made_by"])

    def spec(self, name: str) -> str:
        return self.specs[name]

    def check(self, layers: int, head_dim: int, rope: Rope | None) -> None:
        """ConfigError unless this plan is one for a model of `layers` layers whose engine declares `rope`."""
        if self.layers != layers or self.rope != (rope is not None):
            raise ConfigError(f"a codec plan for {self.layers} layers, RoPE {'declared' if self.rope else 'not'}: "
                              f"not this model's")
        for text in self.specs.values():
            spec = CodecSpec.parse(text)
            spec.check_model(layers, head_dim)
            BlockCodecs.for_spec(spec, rope=rope)  # /unrope without a RoPE: refused


def is_named(codec: str) -> bool:
    """Whether `codec` is a name a codec plan resolves (`int4`, `int2`), not a spec that means itself."""
    return codec.strip().lower() in NAMED


def is_published(model_id: str) -> bool:
    """Whether `model_id` (a fingerprint's) names weights whose tables are published: no calibration needed."""
    return model_id.rpartition("/")[2] in KNOWN


def make_plan(kv: Array, rope: Rope | None, model_id: str, made_by: str = "") -> CodecPlan:
    """The plan of a model whose calibration KV is `kv` [layers, 2, kv_heads, tokens, head_dim] and whose engine
    declares `rope` (or None); `model_id` its weights digest (a published model's tables are used as they are, and
    `kv` need only have its shape)."""
    layers, head_dim = kv.shape[0], kv.shape[4]
    known = KNOWN.get(model_id.rpartition("/")[2])
    specs, sources = {}, set()
    for name in NAMED:
        for i, (options, key_share, value_share) in enumerate(CHOICES[(name, rope is not None)]):
            if i == 0 and known is not None and layers == 30:
                keys, values = known[1][(name, rope is not None)]
                source = f"published: {known[0]}"
            else:
                keys, values = raised_layers(kv, name, _count(key_share, layers), _count(value_share, layers))
                source = f"kv statistics: {max(kv.shape[3] - SINK_TOKENS, 0)} calibration tokens"
            text = _spelled(options, name, keys, values)
            if text and _encodes(text, kv, rope):
                specs[name] = text
                sources.add(source)
                break
        else:
            raise ConfigError(f"no {name} codec encodes this model's KV (head_dim {head_dim})")
    return CodecPlan(layers, rope is not None, specs, "; ".join(sorted(sources)), made_by)


def spec_text(options: str, mode: str, keys: tuple[int, ...], values: tuple[int, ...]) -> str:
    """The canonical spec of `options` with these layers' keys and values one bit up, and /recent=."""
    up = UP_BITS[mode]
    text = options + (f"/k{up}=" + ".".join(map(str, keys)) if keys else "")
    text += (f"/v{up}=" + ".".join(map(str, values)) if values else "") + f"/recent={RECENT[mode]}"
    return CodecSpec.parse(text).name()


def raised_layers(kv: Array, mode: str, keys: int, values: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The `keys` layers whose keys, and the `values` layers whose values, lose the most squared error when
    quantized with one bit more (per token, groups of up to 64 channels, min-max), past the sink block."""
    xp = namespace(kv)
    x = xp.astype(kv[:, :, :, SINK_TOKENS:] if kv.shape[3] > SINK_TOKENS else kv, xp.float32)
    bits = MODE_BITS[mode]
    picked: list[tuple[int, ...]] = []
    for half, count in ((0, keys), (1, values)):
        if not count:
            picked.append(())
            continue
        gain = _error(x[:, half], bits) - _error(x[:, half], bits + 1)  # [layers]
        picked.append(tuple(sorted(int(i) for i in xp.argsort(gain, descending=True, stable=True)[:count])))
    return picked[0], picked[1]


def _error(x: Array, bits: int) -> Array:
    """Mean squared error of each layer's x [layers, kv_heads, tokens, head_dim] quantized min-max at `bits`."""
    xp = namespace(x)
    dim = x.shape[-1]
    group = 64 if dim % 64 == 0 else dim
    g = xp.reshape(contiguous(x), (x.shape[0], -1, group))
    lo, hi = xp.min(g, axis=-1, keepdims=True), xp.max(g, axis=-1, keepdims=True)
    step = xp.clip(hi - lo, 1e-8, None) / (2 ** bits - 1)
    return xp.mean((xp.round((g - lo) / step) * step + lo - g) ** 2, axis=(1, 2))


def _spelled(options: str, mode: str, keys: tuple[int, ...], values: tuple[int, ...]) -> str:
    """`spec_text`, or "" for options this version of the codec does not take."""
    try:
        return spec_text(options, mode, keys, values)
    except ConfigError:
        return ""


def _count(share: float, layers: int) -> int:
    return max(1, round(share * layers)) if share else 0


def _encodes(text: str, kv: Array, rope: Rope | None) -> bool:
    """Whether `text` encodes and decodes a block of this model's KV (a head width it cannot take is refused)."""
    try:
        spec = CodecSpec.parse(text)
        spec.check_model(kv.shape[0], kv.shape[4])
        codec = BlockCodecs.for_spec(spec, rope=rope).main
        xp = namespace(kv)
        block = contiguous(xp.astype(kv[:, :, :, :SINK_TOKENS], xp.float32))
        return tuple(codec.decode(codec.encode(block)).shape) == tuple(block.shape)
    except (KvstashError, ValueError, AssertionError):
        return False
