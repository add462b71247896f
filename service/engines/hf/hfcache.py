"""The one adapter between kvstash KV tensors and the transformers cache API (pinned 5.24).

transformers 5.24 renamed the forward argument and output attribute `past_key_values`
to `cache`; this module is the only place that knows which name the model takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from service.engines.gate import LayerGate

KV_DIMS = 5  # [layers, 2, kv_heads, tokens, head_dim]
ATTENTION = "kvstash"  # the attention `route_attention` gives a model: sdpa, but over a hit's landed codes
ATTEND_MAX_NEW = 4  # new tokens up to which the first step attends over the codes (more: dequantized to a scratch)
# the keyword under which `forward` and `forward_rows` hand `_attention` the cache the step updates: transformers passes
# a forward's extra keywords through to the attention function of every layer
CACHE_KWARG = "kvstash_cache"


def cache_arg(model: PreTrainedModel) -> str:
    """The name under which this model's forward takes the cache ("cache" from 5.24 on)."""
    return _cache_arg_of(type(model))


@functools.cache
def _cache_arg_of(model_type: type) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def empty_cache(model: PreTrainedModel) -> Cache:
    return DynamicCache(config=model.config)


def cache_of_layers(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], model: PreTrainedModel) -> Cache:
    """transformers' own cache of each layer's (K, V) [1, kv_heads, tokens, head_dim], as a plain DynamicCache."""
    return DynamicCache(list(layers), config=model.config)


def route_attention(model: PreTrainedModel) -> None:
    """Run `model`'s attention through this module where it runs sdpa: the same sdpa, but for the first forward step
    over a hit whose frames landed (`LayerGate.attend`), which reads each layer's cached tokens from their
    codes instead of a dequantized copy (`cachestore.codec.attend`), and for a batched step (`RowsCache`). Masks are
    sdpa's. What registers here is a function under a name (transformers looks attention up by its config's name);
    the state it reads comes with each forward (`CACHE_KWARG`)."""
    if model.config._attn_implementation not in ("sdpa", ATTENTION):  # noqa: SLF001 - transformers' own name for it
        return
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


def routed(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention is this module's (`route_attention`)."""
    return bool(model.config._attn_implementation == ATTENTION)  # noqa: SLF001 - transformers' own name for it


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               kvstash_cache: Cache | RowsCache | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: sdpa, unless the cache this step updates (`kvstash_cache`, passed along by
    `forward` and `forward_rows`) says otherwise: a batched step attends each row over its own sequence's cache
    (`RowsCache`), and a hit's first step over a layer whose update just handed its context over attends over the
    layer's landed codes (`GrowingLayer.attend_landed`)."""
    if isinstance(kvstash_cache, RowsCache):
        rows = kvstash_cache.take_rows(key)
        if rows is not None:  # each row over its own sequence's cache
            return torch.cat([sdpa_attention_forward(module, query[b:b + 1], k, v, None, dropout=dropout,
                                                     scaling=scaling, **kwargs)[0]
                              for b, (k, v) in enumerate(rows)]), None
    elif kvstash_cache is not None:
        layer = kvstash_cache.layers[cast(int, module.layer_idx)]  # the index the attention updated the cache at
        if isinstance(layer, GrowingLayer):
            scale = cast(float, module.head_dim) ** -0.5 if scaling is None else scaling
            out = layer.attend_landed(query, key, value, attention_mask, scale)
            if out is not None:  # [q_heads, n, D] -> sdpa's [1, n, q_heads, D]
                return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


class Scratch:
    """One layer's worth of KV [2, kv_heads, tokens, head_dim], shared by a cache's layers in turn (the forward
    step runs them one after another): the first step over a context still being rehydrated reads each layer's
    cached tokens from here, dequantized just before its attention, while they are in the CPU's caches."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """[2, kv_heads, >= tokens, head_dim] of `like`'s [.., kv_heads, .., head_dim], dtype and device."""
        if self._buf is None or self._buf.shape[2] < tokens:
            self._buf = like.new_empty((2, like.shape[1], tokens, like.shape[3]))
        return self._buf


class GrowingLayer(DynamicLayer):
    """A DynamicLayer over a buffer with room to grow: appending a token writes it in place.

    DynamicLayer.update torch.cat's the whole context for every new token: at 2048 tokens that is a
    94 MB copy before the first logit (about a third of a hit's forward step on a CPU). The pod
    decodes the cached blocks into a buffer with spare capacity, so the context is never copied.

    With `ready` and a `scratch`, the first forward step reads this layer's cached tokens from the scratch, where
    the rehydration dequantizes them just before the attention (`LayerGate.fill`), and the context buffer gets
    them at the second step: writing a context larger than the CPU's caches costs a memory-bound machine more
    than the step that reads it, and a one-token reply never writes it at all. With
    `attends` (the model's attention is this module's) and frames a kernel reads (int8, int4, fp16, exact), the
    first step's attention reads them where they landed instead (`LayerGate.attend`): nothing is dequantized into
    memory at all.
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int,
                 ready: LayerGate | None = None, index: int = 0, scratch: Scratch | None = None,
                 attends: bool = False) -> None:
        super().__init__()
        self._ready, self._index = ready, index  # the cached tokens of this layer may still be on their way
        self._scratch = scratch if ready is not None else None  # set only for the first step
        self._attends = attends
        self._attending = False  # `update` handed the context over: the attention that follows reads the codes
        self.device = key_buffer.device
        self.is_initialized = True
        self._key_buf, self._value_buf, self._length = key_buffer, value_buffer, length  # [1, H, cap, D]
        self.keys, self.values = key_buffer[:, :, :length], value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is not None:  # the first step: the cached tokens from the scratch, if the gate can fill it
            scratch, self._scratch = self._scratch, None
            start = self._length
            assert self._ready is not None
            if (self._attends and key_states.shape[0] == 1 and key_states.shape[-2] <= ATTEND_MAX_NEW
                    and self._ready.attending(self._index)):
                self._append(key_states, value_states)
                self._attending = True  # for `attend_landed`, which the attention that comes next calls
                return self.keys, self.values
            buf = scratch.take(key_states, start + key_states.shape[-2])
            if self._ready.fill(self._index, buf[:, :, :start]):
                self._append(key_states, value_states)
                buf[0, :, start:self._length] = key_states[0]
                buf[1, :, start:self._length] = value_states[0]
                return buf[0, :, :self._length].unsqueeze(0), buf[1, :, :self._length].unsqueeze(0)
        self.settle()
        self._append(key_states, value_states)
        return self.keys, self.values

    def attend_landed(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
        """The attention that follows an `update` that handed this layer's context over (`keys` is it): over the
        layer's landed codes (`LayerGate.attend`), [q_heads, new tokens, head_dim]. None otherwise, or where the gate
        cannot: then the context is in place by the time this returns, and sdpa reads it."""
        if not self._attending or keys is not self.keys:
            return None
        self._attending = False
        assert self._ready is not None
        out = self._ready.attend(self._index, query[0], keys[0], values[0], mask, scaling)
        if out is None:
            self._ready.wait(self._index)  # attended over the context instead, once it is in place
        return out

    def settle_from(self, start: int) -> None:
        """`settle` if the context may still lack a cached token from `start` on (the first step read them from the
        scratch): a write-back of a prompt's tail, which the context holds already, writes no layer."""
        if self._ready is not None and (self._scratch is not None or start < self._ready.fills_until):
            self.settle()

    def settle(self) -> None:
        """Put the cached tokens in the context buffer, if they are not yet (blocks until they can be)."""
        self._scratch = None
        if self._ready is not None:  # the forward step reached this layer: its cached tokens must be in place
            self._ready.wait(self._index)
            self._ready = None

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        end = self._length + key_states.shape[-2]
        if end > self._key_buf.shape[-2]:  # out of room: move to a buffer twice as large, once
            self.settle()  # the cached tokens move along
            self._key_buf = self._grow(self._key_buf, end)
            self._value_buf = self._grow(self._value_buf, end)
        self._key_buf[:, :, self._length:end] = key_states
        self._value_buf[:, :, self._length:end] = value_states
        self._length = end
        self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]

    def _grow(self, buf: torch.Tensor, needed: int) -> torch.Tensor:
        bigger = buf.new_empty((*buf.shape[:2], max(needed, 2 * buf.shape[2]), buf.shape[3]))
        bigger[:, :, : self._length] = buf[:, :, : self._length]
        return bigger

    def crop(self, tokens_to_remove: int) -> None:
        self.settle()
        super().crop(tokens_to_remove)
        self._length = self.keys.shape[-2]


def _spare_capacity(kv: torch.Tensor) -> int:
    """Tokens per head that `kv`'s storage holds when it is a token-slice of a contiguous
    [layers, 2, kv_heads, capacity, head_dim] buffer; 0 when it is not."""
    layers, _, heads, tokens, dim = kv.shape
    s0, s1, s2, s3, s4 = kv.stride()
    if s4 != 1 or s3 != dim or s2 % dim or s1 != heads * s2 or s0 != 2 * s1:
        return 0
    capacity = s2 // dim
    last = kv.storage_offset() + (layers - 1) * s0 + s1 + (heads - 1) * s2 + capacity * dim
    if capacity <= tokens or last > kv.untyped_storage().nbytes() // kv.element_size():
        return 0
    return capacity


def cache_from_tensor(kv: torch.Tensor, model: PreTrainedModel, ready: LayerGate | None = None,
                      layers: Sequence[int] | None = None) -> Cache:
    """A DynamicCache holding `kv` [layers, 2, kv_heads, tokens, head_dim], on the model's device and dtype: kv's
    layer i is the model's layer `layers[i]` (all of them in order when None; the others, a sliding-window or linear
    layer's, are left empty for service.engines.hf.boundarycache to fill).

    When `kv` is the first `tokens` of a larger [layers, 2, kv_heads, capacity, head_dim] buffer (as
    the pod's rehydrated context is), generated tokens are appended into that buffer in place, and
    with `ready` each layer is waited for only when the forward step reaches it.
    """
    if kv.dim() != KV_DIMS or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}")
    cache = DynamicCache(config=model.config)
    which = list(range(len(cache.layers))) if layers is None else list(layers)
    if kv.shape[0] != len(which):
        raise ValueError(f"kv has {kv.shape[0]} layers, the model {len(which)}")
    if kv.shape[3] == 0:
        return cache
    capacity = _spare_capacity(kv) if kv.device == model.device and kv.dtype == model.dtype else 0
    if ready is not None and (not capacity or any(type(cache.layers[i]) is not DynamicLayer for i in which)):
        ready.wait_all()  # the context is copied or handed over whole: all of it first
        ready = None
    scratch = Scratch() if ready is not None else None  # the first step's, for every layer in turn
    # route_attention set it; the kernels read fp32 queries on the CPU (else the scratch serves the first step)
    attends = routed(model) and model.device.type == "cpu" and model.dtype == torch.float32
    kv = kv.to(device=model.device, dtype=model.dtype)
    _, _, heads, tokens, dim = kv.shape
    for i, at in enumerate(which):
        layer = cache.layers[at]
        key, value = kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)  # [batch=1, kv_heads, tokens, head_dim]
        if type(layer) is not DynamicLayer:  # sliding-window and other layer kinds keep their own bookkeeping
            layer.update(key, value)
        elif capacity:
            size, stride = (1, heads, capacity, dim), (kv.stride(1), kv.stride(2), dim, 1)
            cache.layers[at] = GrowingLayer(key.as_strided(size, stride), value.as_strided(size, stride), tokens,
                                            ready, i, scratch, attends)
        else:
            # Adopt the tensors as they are: DynamicLayer.update would torch.cat them onto an
            # empty tensor, a full copy of the context that the next forward copies again anyway.
            layer.lazy_initialization(key, value)
            layer.keys, layer.values = key, value
    return cache


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def tensor_from_cache(cache: Cache, start: int = 0, end: int | None = None,
                      which: Sequence[int] | None = None) -> torch.Tensor:
    """Tokens [start, end) of `cache` as one contiguous CPU tensor [layers, 2, kv_heads, end-start, head_dim]: of
    its layers `which` (all when None: the full-attention layers of a model that has others)."""
    layers = cache.layers if which is None else [cache.layers[i] for i in which]
    length = cache_length(cache)
    end = length if end is None else end
    if not 0 <= start <= end <= length:
        raise ValueError(f"range [{start}, {end}) outside a cache of {length} tokens")
    first = layers[0].keys  # [1, kv_heads, tokens, head_dim]
    _, heads, _, dim = first.shape
    out = torch.empty((len(layers), 2, heads, end - start, dim), dtype=first.dtype, device="cpu")
    for i, layer in enumerate(layers):
        if isinstance(layer, GrowingLayer):
            layer.settle_from(start)  # cached tokens read from the scratch so far: into the context first
        out[i, 0].copy_(layer.keys[0, :, start:end])
        out[i, 1].copy_(layer.values[0, :, start:end])
    return out


def forward(
    model: PreTrainedModel,
    input_ids: Sequence[int] | torch.Tensor,
    cache: Cache | None,
    *,
    all_logits: bool = False,
) -> tuple[torch.Tensor, Cache]:
    """Run the new tokens on top of `cache` (grown in place); returns float32 logits and the cache.

    Positions and the causal mask are derived by the model from the cache length: explicit
    position_ids or a mask over the new tokens only would run and give wrong logits.
    Logits are [new_tokens, vocab] with all_logits, else [1, vocab] for the last token.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("forward needs at least one new token")
    if cache is None:
        cache = empty_cache(model)
    kwargs: dict[str, Cache] = {cache_arg(model): cache}
    if routed(model):
        kwargs[CACHE_KWARG] = cache  # for `_attention`
    out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits[0].float(), new_cache


# -- a decoding step of several sequences at once (batch.py) ---------------------------------------------------
class RowsCache:
    """The cache of one batched decoding step: row b of the batch is sequence b, which grows in its own cache.

    Embeddings, projections and MLP run on all rows as one matrix; the attention (`_attention`) attends each row's
    query over its own sequence's keys and values, so a sequence sees exactly the context it would alone (no padding,
    no mask), at its own position.
    """

    def __init__(self, caches: Sequence[Cache]) -> None:
        self.caches = caches
        # the last update's keys and each row's (keys, values), until the attention that follows takes them
        self._rows: tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        # [rows, kv_heads, 1, head_dim]: each row appended to its own sequence's layer
        rows = [cache.layers[layer_idx].update(key_states[b:b + 1], value_states[b:b + 1])
                for b, cache in enumerate(self.caches)]
        self._rows = (key_states, rows)  # for `take_rows`, which the attention that comes next calls
        return key_states, value_states

    def take_rows(self, keys: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each row's (keys, values) from the `update` that returned `keys` (once); None for other keys."""
        if self._rows is None or self._rows[0] is not keys:
            return None
        rows, self._rows = self._rows[1], None
        return rows


def batches_rows(model: PreTrainedModel) -> bool:
    """Whether `forward_rows` can run `model`: its attention is this module's (`route_attention`), and every layer
    an attention layer (full or sliding-window: a linear layer's states are not rows of a RowsCache)."""
    return routed(model) and all(isinstance(layer, DynamicLayer) for layer in DynamicCache(config=model.config).layers)


def forward_rows(model: PreTrainedModel, tokens: Sequence[int], caches: Sequence[Cache]) -> torch.Tensor:
    """One token on top of each of `caches` (each grown in place), in one forward: float32 logits [rows, vocab].

    Positions are each sequence's own length; the 4-D mask is only a placeholder that transformers passes through as
    it is (each row attends to its whole cache, which a single new token may)."""
    if not batches_rows(model):
        raise ValueError("a batched step needs the model's attention routed through hfcache")
    if len(tokens) != len(caches) or not tokens:
        raise ValueError("one token per cache, at least one")
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=model.device).reshape(-1, 1)
    positions = torch.as_tensor([cache_length(c) for c in caches], dtype=torch.long, device=model.device)
    mask = torch.ones((len(caches), 1, 1, 1), dtype=torch.bool, device=model.device)
    rows = RowsCache(caches)
    kwargs = {cache_arg(model): rows, CACHE_KWARG: rows}
    out = model(input_ids=ids, position_ids=positions.reshape(-1, 1), attention_mask=mask, use_cache=True,
                logits_to_keep=1, **kwargs)
    return out.logits[:, -1].float()
