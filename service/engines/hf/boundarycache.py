"""A transformers DynamicCache's boundary state: read at a boundary, put back into a cache to resume there.

The full-attention layers come from the blocks (hfcache.cache_from_tensor); the sliding layers' windows and the linear
layers' conv / recurrent states from a boundary state (service.engines.hf.boundarystate). Put back, each layer's
bookkeeping is what the model left at that position: a sliding layer's `cumulative_length` is P (its masks and the
cache's length, from which the model derives the next positions, read it), a linear layer's states are marked as
holding a previous state (else the next forward would take itself for a prefill from nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, LinearAttentionLayer

from service.engines.hf.boundarystate import StateError, pack_state, unpack_state

__all__ = ["StateError", "put_state", "read_state"]
from service.engines.hf.layout import CONV, WINDOW, HfLayout


def read_state(cache: Cache, layout: HfLayout, position: int, dtype: torch.dtype) -> bytes:
    """The boundary state of `cache`, which holds `position` tokens (StateError if its layers disagree)."""
    parts = []
    for slot in layout.slots:
        layer = cache.layers[slot.layer]
        if slot.kind == WINDOW:
            assert isinstance(layer, DynamicSlidingWindowLayer) and layer.keys is not None and layer.values is not None
            tokens = layout.window_tokens(position)
            if layer.cumulative_length != position or (tokens and layer.keys.shape[-2] < tokens):
                raise StateError(f"layer {slot.layer} has seen {layer.cumulative_length} tokens, not {position}")
            # [2, kv_heads, tokens, head_dim]: K and V of the last `tokens` positions
            tensor = torch.stack([layer.keys[0, :, layer.keys.shape[-2] - tokens:],
                                  layer.values[0, :, layer.values.shape[-2] - tokens:]]) if tokens else \
                torch.empty((2, *slot.shape[:1], 0, *slot.shape[1:]), dtype=dtype)
        else:
            assert isinstance(layer, LinearAttentionLayer)
            states = layer.conv_states if slot.kind == CONV else layer.recurrent_states
            held = states[slot.index]
            if held is None:
                raise StateError(f"layer {slot.layer} holds no state {slot.describe()}")
            tensor = held[0]
        parts.append((slot, tensor))
    return pack_state(position, dtype, parts)


def put_state(cache: Cache, layout: HfLayout, state: bytes | Sequence[torch.Tensor], position: int,
              dtype: torch.dtype, device: torch.device) -> None:
    """Set `cache`'s sliding and linear layers to `state` at `position` (its bytes, checked, or its tensors as
    `unpack_state` gives them); the full-attention layers are the caller's."""
    tensors = unpack_state(state, layout, position, dtype) if isinstance(state, (bytes, memoryview)) else state
    for slot, tensor in zip(layout.slots, tensors, strict=True):
        layer = cache.layers[slot.layer]
        part = tensor.unsqueeze(0).to(device=device, dtype=dtype)  # [batch=1, ...]
        if slot.kind == WINDOW:
            assert isinstance(layer, DynamicSlidingWindowLayer)
            keys, values = part[:, 0].contiguous(), part[:, 1].contiguous()  # [1, kv_heads, tokens, head_dim]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            layer.cumulative_length = position
            continue
        assert isinstance(layer, LinearAttentionLayer)
        if slot.kind == CONV:
            if not layer.is_conv_states_initialized[slot.index]:
                layer.lazy_initialization(conv_states=part, state_idx=slot.index, conv_kernel_size=part.shape[-1])
            held = layer.conv_states[slot.index]
        else:
            if not layer.is_recurrent_states_initialized[slot.index]:
                layer.lazy_initialization(recurrent_states=part, state_idx=slot.index)
            held = layer.recurrent_states[slot.index]
        assert held is not None
        held.copy_(part)  # in place: the layer keeps its tensor's address (cudagraphs)
        layer.has_previous_state[slot.index] = True
