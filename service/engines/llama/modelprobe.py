"""The llamacpp engine's model facts: GGUF metadata, and the layouts of layers and sequence state it probes at load."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from cachestore.codec.q8 import Q8_BLOCK, Q8_BYTES
from cachestore.errors import ConfigError
from service.engines.base import KvGeometry
from service.engines.llama import boundarystate, ggufmeta, llamastate, statelayout, statewrite
from service.engines.llama.scheduler import Scheduler

PINNED_VERSION = "0.3.36"  # llama-cpp-python; the state layout in llamastate is read from this version


class ModelProbe(Scheduler):
    """`LlamaCppEngine`'s reads of its model: metadata, which layers keep what, and the sequence-state layout."""

    _model: Any
    path: Path
    kv_type: str
    geometry: KvGeometry
    layout: statelayout.ModelLayout
    _section_kinds: tuple[str, ...]
    _bos: int

    # -- model facts -----------------------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        arch = self._meta_raw("general.architecture")
        for full in (f"{arch}.{key}" if arch else key, key):
            n = self._lib.llama_model_meta_val_str(self._model, full.encode(), buf, 512)
            if n >= 0:
                return buf.value.decode("utf-8", errors="replace")
        return None

    def _meta_raw(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def _meta_int(self, key: str) -> int:
        value = self._meta(key)
        return int(value) if value and value.isdigit() else 0

    def _probe_model_layout(self) -> statelayout.ModelLayout:
        """Which layers keep full-attention KV, sliding-window KV or a recurrent state: decode two tokens in sequence
        0 and read the sections of its state (statelayout), checked against what the GGUF says of its layers."""
        lib, model = self._lib, self._model
        arch = self._meta_raw("general.architecture") or "unknown"
        n_layer, n_swa = int(lib.llama_model_n_layer(model)), int(lib.llama_model_n_swa(model))
        hybrid, recurrent = bool(lib.llama_model_is_hybrid(model)), bool(lib.llama_model_is_recurrent(model))
        pattern_key, heads_key = f"{arch}.attention.sliding_window_pattern", f"{arch}.attention.head_count_kv"
        meta = ggufmeta.read_meta(self.path, (pattern_key, heads_key)) if n_swa > 0 or hybrid else {}
        sliding = statelayout.sliding_layers(arch, n_layer, meta.get(pattern_key)) if n_swa > 0 else ()
        rec_layers = (tuple(range(n_layer)) if recurrent else
                      statelayout.recurrent_layers(n_layer, meta.get(heads_key)) if hybrid else ())
        self._decode_tokens([(self._bos, 0, 0, False), (self._bos, 1, 0, True)])
        size = self._state_size(0)
        blob = self._get_state(0, bytearray(size), size)
        lib.llama_memory_seq_rm(self._mem, 0, -1, -1)
        try:
            self._section_kinds = statelayout.section_kinds(n_swa, hybrid, recurrent)
            sections = statelayout.read_sections(blob, self._section_kinds)
            return statelayout.model_layout(arch, n_layer, n_swa, sections, sliding, rec_layers)
        except llamastate.StateLayoutError as exc:
            self._free_native()
            raise ConfigError(f"{self.path.name}: llama.cpp's sequence state is not one kvstash reads ({exc})"
                              ) from None

    def _attention_geometry(self, head_dim: int, per_seq: int) -> KvGeometry:
        """The geometry of a sliding-window or hybrid model's blocks: its full-attention layers alone (one row width
        for all of them), or a one-line refusal naming the layout where there are none."""
        layout = self.layout
        rows = set(layout.kv_row_bytes[:layout.full])
        if layout.full == 0 or len(rows) != 1 or self._section_kinds[0] != statelayout.KV:
            self._free_native()
            raise ConfigError(f"{self.path.name} is {layout.describe()}; kvstash caches models with full-attention "
                              "layers of one width beside their sliding-window or recurrent layers")
        row = rows.pop()
        elements = row // 2 if self.kv_type == "f16" else row // Q8_BYTES * Q8_BLOCK
        return KvGeometry(layout.full, elements // head_dim, head_dim, self.geometry.dtype, per_seq)

    def _split(self, blob: bytes | bytearray | memoryview) -> tuple[int, bytes]:
        """Where a state's full-attention KV ends, and its boundary state (`boundarystate.split_state`): the window or
        recurrent sections after it, of one stream; (its length, b"") for a full-attention model."""
        if not self.boundary_records:
            return len(blob), b""
        return boundarystate.split_state(blob, self._section_kinds)

    def _free_native(self) -> None:
        """Free what llama.cpp holds for this engine when it refuses to start (`close` does it after)."""
        self._lib.llama_batch_free(self._batch)
        self._lib.llama_free(self._ctx)
        self._lib.llama_model_free(self._model)

    def _probe_layout(self) -> llamastate.StateGeometry:
        """Decode two tokens in sequence 0 and read its state back: the running llama.cpp must write the
        layout llamastate reads, or the pod refuses to start (one line), never corrupting a cache."""
        self._decode_tokens([(self._bos, 0, 0, False), (self._bos, 1, 0, True)])
        size = self._state_size(0)
        blob = self._get_state(0, bytearray(size), size)
        self._lib.llama_memory_seq_rm(self._mem, 0, -1, -1)
        try:
            blob = blob[:self._split(blob)[0]]  # the full-attention KV: what blocks hold
            facts = llamastate.read_facts(blob)
            if facts is None:
                raise llamastate.StateLayoutError("the state of a decoded sequence holds no cells")
            g = self.geometry
            geo = llamastate.StateGeometry(g.num_layers, g.kv_heads, g.head_dim, facts.v_trans, facts.n_stream,
                                           facts.kv_type)
            if facts.kv_type != llamastate.KV_TYPES[self.kv_type]:
                raise llamastate.StateLayoutError(f"K of ggml type {facts.kv_type}, not the {self.kv_type} asked for")
            if facts.num_layers != g.num_layers or facts.row_elements != g.kv_heads * g.head_dim:
                raise llamastate.StateLayoutError(f"state of {facts.num_layers} layers x {facts.row_elements}, "
                                                  f"model {g.num_layers} x {g.kv_heads * g.head_dim}")
            kv = llamastate.parse_state(blob, geo)
            if bytes(statewrite.assemble_state(kv, geo, seq_id=0)) != bytes(blob):
                raise llamastate.StateLayoutError("re-assembled state differs from llama.cpp's")
        except llamastate.StateLayoutError as exc:
            raise ConfigError(f"llama.cpp's sequence-state layout is not the one kvstash reads ({exc}); "
                              f"install llama-cpp-python=={PINNED_VERSION}") from None
        return geo
