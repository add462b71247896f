"""Which kind of memory each layer of a transformers model keeps, read from the pinned transformers' own cache.

`DynamicCache(config=...)` gives each layer its class: a `DynamicLayer` keeps full-attention KV of every position (the
blocks), a `DynamicSlidingWindowLayer` the KV of its last `sliding_window - 1` positions, a `LinearAttentionLayer`
fixed-size conv and recurrent states (LFM2's short convolutions, Mamba-like mixers). The hf engine stores the first
kind as blocks and the rest as boundary states (service.engines.hf.boundarystate) at replayable boundaries; any other
layer class is refused at start-up in one line naming the layout. The shapes of the states are read once from a
probe forward, so the layout is what the model really keeps, not what its config promises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from cachestore.codec.rope import HALVES, Rope
from cachestore.errors import CodecError, ConfigError

WINDOW, CONV, RECURRENT = 1, 2, 3  # what a boundary state's slot holds
_KIND_NAMES = {WINDOW: "window", CONV: "conv", RECURRENT: "recurrent"}
_PROBE_TOKENS = 3


@dataclass(frozen=True)
class StateSlot:
    """One tensor of a boundary state: a sliding layer's window (K and V stacked, [2, kv_heads, tokens, head_dim]) or
    one of a linear layer's conv / recurrent states (its shape less the batch dimension)."""

    layer: int
    kind: int  # WINDOW, CONV or RECURRENT
    index: int  # transformers' state_idx of a linear layer's state; 0 for a window
    shape: tuple[int, ...]  # WINDOW: (kv_heads, head_dim), the tokens vary with the position; else the whole shape

    def describe(self) -> str:
        return f"{self.layer}{_KIND_NAMES[self.kind][0]}{self.index}=" + "x".join(str(d) for d in self.shape)


@dataclass(frozen=True)
class HfLayout:
    """A model's layers by kind, and the slots of its boundary state (empty for full attention only)."""

    arch: str
    n_layer: int
    full: tuple[int, ...]  # layers of full-attention KV: the blocks' layers, in order
    kv_heads: int  # of the full-attention layers
    head_dim: int
    sliding: tuple[int, ...] = ()
    window: int = 0  # transformers' sliding_window: a sliding layer keeps the last window - 1 positions
    recurrent: tuple[int, ...] = ()  # linear layers (conv / recurrent states)
    slots: tuple[StateSlot, ...] = ()

    @property
    def boundary_records(self) -> bool:
        return bool(self.slots)

    def window_tokens(self, position: int) -> int:
        """Positions a sliding layer holds after `position` tokens."""
        return min(position, max(self.window - 1, 0))

    def tag(self) -> str:
        """What the fingerprint adds: nothing for full attention only (those fingerprints stay), else the layers of
        each kind, the window and every state slot's shape."""
        if not self.boundary_records:
            return ""
        parts = [f"/layout:{self.arch}:{self.n_layer}/full:{layer_ranges(self.full)}"]
        if self.sliding:
            parts.append(f"/swa{self.window}:{layer_ranges(self.sliding)}")
        if self.recurrent:
            parts.append(f"/rec:{layer_ranges(self.recurrent)}")
        parts.append("/state:" + ",".join(slot.describe() for slot in self.slots))
        return "".join(parts)

    def describe(self) -> str:
        """One line: "gemma3_text, 6 layers: 5 sliding-window (window 32; layers 0-4), 1 full-attention (layer 5)"."""
        kinds = []
        if self.sliding:
            kinds.append(f"{len(self.sliding)} sliding-window (window {self.window}; {_layers(self.sliding)})")
        if self.recurrent:
            kinds.append(f"{len(self.recurrent)} conv/recurrent ({_layers(self.recurrent)})")
        kinds.append(f"{len(self.full)} full-attention ({_layers(self.full)})")
        return f"{self.arch}, {self.n_layer} layers: {', '.join(kinds)}"


def layer_ranges(layers: Sequence[int]) -> str:
    """0,1,2,3,4,6 -> "0-4,6"."""
    out: list[str] = []
    for il in layers:
        if out and out[-1].split("-")[-1] == str(il - 1):
            out[-1] = out[-1].split("-")[0] + f"-{il}"
        else:
            out.append(str(il))
    return ",".join(out) or "none"


def _layers(layers: Sequence[int]) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + layer_ranges(layers)


def _refusal(name: str, model: PreTrainedModel, kinds: list[str], why: str) -> ConfigError:
    config = model.config.get_text_config(decoder=True)
    named = list(getattr(config, "layer_types", None) or [])
    kinds = named if len(named) == len(kinds) else kinds
    parts = [f"{kinds.count(kind)} {kind} ({_layers([i for i, k in enumerate(kinds) if k == kind])})"
             for kind in dict.fromkeys(kinds)]
    return ConfigError(f"{name} is {config.model_type}, {len(kinds)} layers: {', '.join(parts)}; {why}")


def probe_layout(name: str, model: PreTrainedModel) -> HfLayout:
    """The layout of `model` (`name` for the refusal): ConfigError, in one line naming its layers, for a layer class
    this engine cannot store, or a model without full-attention layers (blocks need one)."""
    config = model.config.get_text_config(decoder=True)
    layers = DynamicCache(config=model.config).layers
    classes = [type(layer) for layer in layers]
    known = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
    if any(cls not in known for cls in classes) or DynamicLayer not in classes:
        raise _refusal(name, model, [cls.__name__ for cls in classes], "the hf engine caches full-attention KV, with "
                       "sliding-window KV and conv/recurrent states beside it")
    heads = int(config.num_attention_heads)
    arch = str(config.model_type)
    full = tuple(i for i, cls in enumerate(classes) if cls is DynamicLayer)
    if all(cls is DynamicLayer for cls in classes):
        return HfLayout(arch, len(classes), full, int(getattr(config, "num_key_value_heads", None) or heads),
                        int(getattr(config, "head_dim", None) or config.hidden_size // heads))
    cache = _probe_cache(model)
    shapes = {_width(cache.layers[i]) for i in full}
    if len(shapes) != 1:
        raise ConfigError(f"{name}: full-attention layers of several widths {sorted(shapes)}; blocks hold one")
    (kv_heads, head_dim), = shapes
    slots: list[StateSlot] = []
    windows = set()
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            windows.add(int(layer.sliding_window))
            slots.append(StateSlot(i, WINDOW, 0, _width(layer)))
        elif isinstance(layer, LinearAttentionLayer):
            for kind, states, ready in ((CONV, layer.conv_states, layer.is_conv_states_initialized),
                                        (RECURRENT, layer.recurrent_states, layer.is_recurrent_states_initialized)):
                slots += [StateSlot(i, kind, idx, tuple(int(d) for d in state.shape[1:]))
                          for idx in sorted(states) if ready[idx] and (state := states[idx]) is not None]
    if len(windows) > 1:
        raise ConfigError(f"{name}: sliding layers of several windows {sorted(windows)}")
    return HfLayout(arch, len(classes), full, kv_heads, head_dim,
                    sliding=tuple(i for i, cls in enumerate(classes) if cls is DynamicSlidingWindowLayer),
                    window=windows.pop() if windows else 0,
                    recurrent=tuple(i for i, cls in enumerate(classes) if cls is LinearAttentionLayer),
                    slots=tuple(slots))


def _width(layer: object) -> tuple[int, int]:
    """(kv_heads, head_dim) of an attention layer that holds KV."""
    assert isinstance(layer, DynamicLayer) and layer.keys is not None
    return int(layer.keys.shape[1]), int(layer.keys.shape[3])


def _probe_cache(model: PreTrainedModel) -> DynamicCache:
    """The cache of a few tokens fed to `model`: every layer's state as the model keeps it."""
    from service.engines.hf.hfcache import forward  # noqa: PLC0415  (hfcache imports nothing of this module)

    with torch.inference_mode():
        _, cache = forward(model, list(range(1, _PROBE_TOKENS + 1)), None)
    assert isinstance(cache, DynamicCache)
    return cache


def rope_of(model: PreTrainedModel, head_dim: int) -> Rope | None:
    """The RoPE transformers gives the cached keys (`rotate_half`: channel i turns with i + head_dim / 2), when one
    rotary embedding turns every layer's whole head by a plain rotation; else None (partial rotary dims, attention
    scaling such as YaRN's, per-layer rotaries as Gemma 3's local and global ones, no rotary at all)."""
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.numel() * 2 != head_dim:
        return None
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        return None
    try:
        return Rope(HALVES, tuple(float(f) for f in inv_freq.float().tolist()))
    except CodecError:
        return None
