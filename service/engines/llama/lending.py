"""Sequence states lent to the pipeline as contexts: a hit lands in the state a llama.cpp runtime is handed.

Both llama.cpp engines take cached KV as llama.cpp sequence state: the in-process one sets it
(`llama_state_seq_set_data`), the sidecar writes it into a slot file for llama-server to restore. A context
lent from here is a pooled state buffer, laid out, whose K and V a hit fills where the state holds them:

- F16: the tensor lent is a float16 view of the state's K and V (`statewrite.state_view`): whatever the
  pipeline writes into it (frames dequantized, a tail) is the state.
- Q8_0: no float view exists, so a float32 tensor is lent beside the state (`rows_apart`). q8 frames are
  received into the state's rows (`rows`, then `mark_placed`), never through the tensor; cells past the
  placed ones (a tail, a session's partial block) are quantized from the tensor into the state by `take`.

Token-rows frames (`CodecSpec.rows`) are received straight into the state either way (`rows`).

- F16 with V stored transposed (llama.cpp without flash attention), where the engine asks for it
  (`transposed_v`): the tensor lent views each layer's V as rows, in the region where the state keeps it
  transposed, and `settle` puts V in place before the state is set (`statewrite.transpose_v`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachestore.codec.arrays import Array, ptr, strides
from cachestore.codec.rope import Rope
from cachestore.wire import Target
from service.engines.base import Engine, KvGeometry, KvLayout
from service.engines.llama import llamastate, statewrite
from service.engines.llama.statelayout import ModelLayout
from service.engines.llama.targets import row_targets
from service.runtime.contextpool import IdlePool

STATE_ROUND_BYTES = 4 << 20  # pooled state buffers are rounded up so that one also fits later, longer states


def kv_layout(state_geometry: llamastate.StateGeometry, layout: ModelLayout, rope: Rope | None = None) -> KvLayout:
    """What a llama.cpp sequence state says of its KV, as the seam's data: token rows, V transposed without flash
    attention, rows apart from the tensor lent beside a q8_0 state (no float view of it), the layers, and the RoPE
    its keys carry (`gguf.gguf_rope`)."""
    return KvLayout(token_rows=True, v_transposed=state_geometry.v_trans,
                    rows_apart=state_geometry.kv_type != llamastate.GGML_TYPE_F16, sliding=layout.sliding,
                    window=layout.n_swa, recurrent=layout.recurrent, tag=layout.tag(), rope=rope)


def state_buffers(keep: int) -> IdlePool[bytearray]:
    """Sequence-state buffers kept between requests: a fresh 47 MB bytearray, a 2048-token state of SmolLM2,
    costs ~17 ms of zeroing and page faults before a hit can be set."""
    return IdlePool(len, lambda size: bytearray(-(-size // STATE_ROUND_BYTES) * STATE_ROUND_BYTES), keep)


@dataclass
class Lent:
    """A context lent: the pooled state buffer, its cells, and (beside a q8_0 state) the float32 tensor lent with it
    and how many leading cells were received into the state as rows."""

    state: bytearray
    cells: int
    tensor: Array | None = None
    placed: int = 0
    v_rows: bool = False  # V still lies as rows where the state holds it transposed (`settle` puts it in place)


class StateLender:
    """The contexts an engine lends, by the address of the tensor lent (thread-safe)."""

    def __init__(self, state_geometry: llamastate.StateGeometry, geometry: KvGeometry,
                 buffers: IdlePool[bytearray], layout: KvLayout, transposed_v: bool = False) -> None:
        self.state_geometry, self.geometry, self.buffers = state_geometry, geometry, buffers
        # V stored transposed is lent as rows, and put in place by `settle`, only where the engine sets the state
        # itself (llama.cpp in the pod); a slot file is written from the state's own bytes (the sidecar)
        self.transposed_v = transposed_v and layout.v_transposed
        # a q8_0 state has no float view: the tensor lent lies beside it, and rows received into the state (q8
        # frames) never pass through the tensor
        self.rows_apart = layout.rows_apart
        self._lent: dict[int, Lent] = {}
        self._lock = threading.Lock()

    def context_for(self, tokens: int) -> Array | None:
        """A [layers, 2, kv_heads, tokens, head_dim] context whose K and V become a state of `tokens` cells: a
        float16 view of the state, or a float32 tensor beside a q8_0 one. None where V is stored transposed (no
        rows to land in), unless the engine asked for it (`transposed_v`). Back with `give_context` once nothing reads
        or writes it."""
        geo = self.state_geometry
        if tokens <= 0 or (geo.v_trans and not self.transposed_v):
            return None
        buf = self.buffers.take(llamastate.state_size(tokens, geo))
        if self.rows_apart:  # only what is written into the tensor is ever touched
            statewrite.lay_out(buf, tokens, geo)
            g = self.geometry
            kv = np.empty((g.num_layers, 2, g.kv_heads, tokens, g.head_dim), dtype=g.dtype)
        else:
            made = statewrite.state_view(tokens, geo, into=buf, v_as_rows=self.transposed_v)
            assert made is not None
            kv = made[1]
        with self._lock:
            self._lent[ptr(kv)] = Lent(buf, tokens, kv if self.rows_apart else None, v_rows=self.transposed_v)
        return kv

    def mark_placed(self, kv: Array, tokens: int) -> None:
        """Cells [0, tokens) of a context lent were received into its state as rows (`rows`) and verified; where rows
        lie apart from the tensor (q8_0), the cells after them are taken from the tensor (`take`)."""
        with self._lock:
            lent = self._lent.get(ptr(kv))
            if lent is not None:
                lent.placed = max(0, min(tokens, lent.cells))

    def rows(self, kv: Array, start: int, count: int) -> list[memoryview] | None:
        """Where cells [start, start + count) of a context lent hold their K and V rows (per layer its K, then its V:
        a token-rows frame's payload, received there); None for any other tensor."""
        with self._lock:
            lent = self._lent.get(ptr(kv))
        if lent is None or start + count > lent.cells:
            return None
        return statewrite.row_pieces(lent.state, lent.cells, self.state_geometry, start, count)

    def give_back(self, kv: Array) -> bool:
        """Take back a context lent; False for any other tensor."""
        with self._lock:
            lent = self._lent.pop(ptr(kv), None)
        if lent is None:
            return False
        self.buffers.give(lent.state)
        return True

    def is_lent(self, kv: Array) -> bool:
        """Whether `kv` starts where a context lent starts, and that context has not come back."""
        with self._lock:
            return ptr(kv) in self._lent

    @property
    def lent(self) -> int:
        """Contexts lent and not yet given back."""
        with self._lock:
            return len(self._lent)

    def take(self, cached_kv: Array, cached: int) -> Lent | None:
        """The lent context `cached_kv` is (its first `cached` cells or more), with those cells in its state; None
        when it is no context lent, or a view of one in another shape. Beside a q8_0 state, the cells not received
        as rows (`mark_placed`) are quantized into the state from the tensor first. The context stays lent."""
        with self._lock:
            lent = self._lent.get(ptr(cached_kv))
        if lent is None or cached > lent.cells:
            return None
        if lent.tensor is not None:
            if cached > lent.placed:
                statewrite.write_q8_rows(lent.state, lent.cells, self.state_geometry, lent.placed,
                                         lent.tensor[:, :, :, lent.placed:cached])
            return lent
        expected = statewrite.state_view_strides(lent.cells, self.state_geometry)
        return lent if strides(cached_kv) == expected else None

    def settle(self, lent: Lent) -> None:
        """A lent state about to be set as it is: V put in place where it was lent as rows (once: the tensor lent no
        longer holds it as rows after this, and is read no more)."""
        if lent.v_rows:
            statewrite.transpose_v(lent.state, lent.cells, self.state_geometry)
            lent.v_rows = False


class LendsStates(Engine):
    """An engine's side of lending (both llama.cpp engines): the context methods the pipeline calls, on `_lender`."""

    _lender: StateLender

    def context_for(self, tokens: int) -> Array | None:
        """A [layers, 2, kv_heads, tokens, head_dim] context whose K and V become a pooled sequence state of `tokens`
        cells: a hit received or dequantized into it is handed to llama.cpp as it is, none assembled (a copy of the
        whole KV, 9.5 ms at 2048 SmolLM2 tokens). None where V is stored transposed. Back with `give_context` once
        nothing reads or writes it."""
        return self._lender.context_for(tokens)

    def landing_targets(self, context: Array, blocks: int, block_tokens: int,
                        checksummed: bool = True) -> Sequence[Target] | None:
        """Each block's `Scatter` into the state of `context`, a context lent: its header apart, its rows where the
        state holds them (`context_rows`); None for any other tensor."""
        return row_targets(lambda start, count: self._lender.rows(context, start, count), blocks, block_tokens,
                           checksummed)

    def mark_placed(self, kv: Array, tokens: int) -> None:
        """Cells [0, tokens) of a context lent were received into its state as rows (`context_rows`) and verified."""
        self._lender.mark_placed(kv, tokens)

    def context_rows(self, kv: Array, start: int, count: int) -> list[memoryview] | None:
        """Where cells [start, start + count) of a context lent hold their K and V rows; None for any other tensor."""
        return self._lender.rows(kv, start, count)

    def give_context(self, kv: Array) -> bool:
        """Take back a context `context_for` lent; False for any other tensor."""
        return self._lender.give_back(kv)

    def is_lent(self, kv: Array) -> bool:
        """Whether `kv` starts where a context `context_for` lent starts, and that context has not come back."""
        return self._lender.is_lent(kv)

    @property
    def contexts_lent(self) -> int:
        """Contexts lent and not yet given back."""
        return self._lender.lent
