"""The one adapter between kvstash KV tensors and the transformers cache API (pinned 5.24).

transformers 5.24 renamed the forward argument and output attribute `past_key_values`
to `cache`; this module is the only place that knows which name the model takes.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence

os.environ["HF_HUB_OFFLINE"] = "1"  # as in service.models, whichever is imported first

import torch  # noqa: E402
from transformers import DynamicCache, PreTrainedModel  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

KV_DIMS = 5  # [layers, 2, kv_heads, tokens, head_dim]


def _cache_arg(model: PreTrainedModel) -> str:
    """The name under which this model's forward takes the cache ("cache" from 5.24 on)."""
    return _cache_arg_of(type(model))


@functools.cache
def _cache_arg_of(model_type: type) -> str:
    params = inspect.signature(model_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def empty_cache(model: PreTrainedModel) -> Cache:
    return DynamicCache(config=model.config)


def cache_from_tensor(kv: torch.Tensor, model: PreTrainedModel) -> Cache:
    """A DynamicCache holding `kv` [layers, 2, kv_heads, tokens, head_dim], on the model's device and dtype."""
    if kv.dim() != KV_DIMS or kv.shape[1] != 2:
        raise ValueError(f"kv must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}")
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if kv.shape[0] != layers:
        raise ValueError(f"kv has {kv.shape[0]} layers, the model {layers}")
    if kv.shape[3] == 0:
        return empty_cache(model)
    kv = kv.to(device=model.device, dtype=model.dtype)
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        key, value = kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)  # [batch=1, kv_heads, tokens, head_dim]
        if type(layer) is DynamicLayer:
            # Adopt the tensors as they are: DynamicLayer.update would torch.cat them onto an
            # empty tensor, a full copy of the context that the next forward copies again anyway.
            layer.lazy_initialization(key, value)
            layer.keys, layer.values = key, value
        else:  # sliding-window and other layer kinds keep their own bookkeeping
            layer.update(key, value)
    return cache


def cache_length(cache: Cache) -> int:
    return int(cache.get_seq_length())


def tensor_from_cache(cache: Cache, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Tokens [start, end) of `cache` as one contiguous CPU tensor [layers, 2, kv_heads, end-start, head_dim]."""
    layers = cache.layers
    length = cache_length(cache)
    end = length if end is None else end
    if not 0 <= start <= end <= length:
        raise ValueError(f"range [{start}, {end}) outside a cache of {length} tokens")
    first = layers[0].keys  # [1, kv_heads, tokens, head_dim]
    _, heads, _, dim = first.shape
    out = torch.empty((len(layers), 2, heads, end - start, dim), dtype=first.dtype, device="cpu")
    for i, layer in enumerate(layers):
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
    kwargs = {_cache_arg(model): cache}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if all_logits else 1, **kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits[0].float(), new_cache
