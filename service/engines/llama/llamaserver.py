"""The `llama-server` engine: kvstash as a sidecar of a stock llama-server, sharing KV through Redis.

Prompts are token ids from llama-server's own /apply-template and /tokenize, sent back to it as ids, so
both sides see the same sequence. Cached KV enters a slot as a slot file (service.engines.llama.slotfile)
written into the directory llama-server saves slots to (`--slot-save-path`) and `POST /slots/{id}?action=
restore`; the reply comes from `POST /completion` on that slot with `cache_prompt`; the slot is then saved
and its file parsed into the KV the pod writes back. llama-server's timings (`cache_n`, `prompt_n`) say what
it really reused: a restore it did not honour, a restart that emptied its slots, a refused or corrupt
file all cost a prefill (counted in `stats`), never a wrong answer.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from cachestore.codec.arrays import Array
from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint
from service.engines.chat import chat_token_ids
from service.engines.generation import Generation, GenRequest, ParamError, reply_ids
from service.engines.llama import PARALLEL, boundarystate, llamastate, slotfile, statelayout
from service.engines.llama.gguf import (
    check_flash_attn,
    file_digest,
    gguf_facts,
    gguf_fingerprint,
    gguf_geometry,
    gguf_rope,
)
from service.engines.llama.lending import LendsStates, StateLender, kv_layout, state_buffers
from service.engines.llama.llamaserverproc import LlamaServerProcess
from service.engines.llama.models import resolve_gguf
from service.engines.llama.serverhttp import ServerHttp
from service.engines.llama.slots import SidecarStats, Slot, UpstreamError
from service.engines.server import SlotServer

log = logging.getLogger("kvstash.llamaserver")

REQUEST_TIMEOUT_S = 600.0
SWA_FULL = "--swa-full"  # llama-server keeps every position of sliding-window layers: a restored slot is reusable


class LlamaServerEngine(ServerHttp, LendsStates, SlotServer):
    """Generation forwarded to one llama-server, its slots filled from and saved to kvstash's cache."""

    kind = "llama-server"
    layerwise = False  # the KV goes to llama-server as one slot file
    runs_torch = False  # llama-server computes in its own process

    def __init__(
        self, upstream: str, slot_dir: Path, model: str, *, reuse_slots: bool = True,
        process: LlamaServerProcess | None = None, api_key: str = "",
    ) -> None:
        self.url = upstream.rstrip("/")
        # llama-server's --api-key: the sidecar's own calls (props, tokenize, slots) present it
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.slot_dir = Path(slot_dir)
        self.process = process
        self.owns_slot_dir = False
        self.reuse_slots = reuse_slots  # False (--no-cache): every request prefills, as a baseline
        self.path = resolve_gguf(model)
        self.name = model if model == "smollm2" else self.path.stem
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0),
                                  headers=self.auth)
        try:
            props = self._json("GET", "/props")
            if props.get("role") == "router":
                self._http.close()
                raise ConfigError(f"llama-server at {self.url} runs in router mode (several models); a sidecar "
                                  "fronts a llama-server of one model: run one llama-server and one sidecar per model")
            # adapters loaded with --lora: their scales are part of a request's KV (docs/sidecar.md, "Identity")
            self.adapters = [(int(a.get("id", i)), str(a.get("path", ""))) for i, a in
                             enumerate(self._json_list("GET", "/lora-adapters"))]
        except (httpx.HTTPError, UpstreamError) as exc:
            self._http.close()
            hint = " (started with --api-key? give the sidecar --upstream-api-key)" if "401" in str(exc) else ""
            raise ConfigError(f"llama-server at {self.url} does not answer /props: {exc}{hint}") from None
        self.multimodal = bool(props.get("modalities", {}).get("vision") or props.get("modalities", {}).get("audio"))
        self.parallel = int(props.get("total_slots") or 1)
        n_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or 0)
        self.geometry = gguf_geometry(self.path, n_ctx)
        self._template = str(props.get("chat_template") or "")
        self.build_info = str(props.get("build_info") or "")
        bos = self._tokenize("", special=True, add_special=True)
        self._bos = bos[0] if bos else None
        self._digest = file_digest(self.path)
        self._prefix = f"kvstash-{os.getpid()}-{id(self) & 0xFFFF:x}"
        self._slots = [Slot(i) for i in range(self.parallel)]
        self._cond = threading.Condition()
        self.stats = SidecarStats()
        self._restarts_seen = process.restarts if process else 0
        self.boundary_records = False  # a sliding-window or hybrid model: set by the probe
        self._section_kinds: tuple[str, ...] = (statelayout.KV,)
        self.state_geometry = self._probe_layout()
        # a hit lands in the sequence state of the slot file it is restored from (lending): exact and
        # fp16 frames as token rows, the order the state holds K and V in, and q8 frames (always rows) are received
        # there as they are; nothing is dequantized into a tensor and assembled again
        self.kv_layout = kv_layout(self.state_geometry, self.layout, gguf_rope(self.path, self.geometry.head_dim))
        self._lender = StateLender(self.state_geometry, self.geometry, state_buffers(keep=self.parallel),
                                   self.kv_layout)

    @classmethod
    def spawn(
        cls, model: str, slot_dir: Path | None = None, *, parallel: int = PARALLEL, threads: int = 0,
        ctx_per_slot: int = 8192,
        binary: Path | None = None, extra_args: Sequence[str] = (), reuse_slots: bool = True, kv_type: str = "f16",
        flash_attn: str = "auto", api_key: str = "",
    ) -> LlamaServerEngine:
        """Start (and supervise) a llama-server of `parallel` slots, then the engine in front of it. Without
        `slot_dir`, slots are saved in a fresh directory (in shared memory where there is one), removed on close.
        `kv_type` "q8_0" runs its KV cache as q8_0 (`--cache-type-k/v q8_0 -fa on`, what a sidecar of codec q8 stores
        as it is: `kv_cache_type`), unless `extra_args` name a cache type of their own. `flash_attn`
        other than "auto" is passed as `-fa`, unless `extra_args` name it. `api_key`: llama-server is started with
        it (`--api-key-file`), and the engine presents it."""
        llamastate.check_kv_type(kv_type)
        check_flash_attn(flash_attn, kv_type)
        if kv_type != "f16" and not any(a.startswith("--cache-type") or a in ("-ctk", "-ctv") for a in extra_args):
            extra_args = ("--cache-type-k", kv_type, "--cache-type-v", kv_type, "-fa", "on", *extra_args)
        if flash_attn != "auto" and not any(a in ("-fa", "--flash-attn") for a in extra_args):
            extra_args = ("-fa", flash_attn, *extra_args)
        if gguf_facts(resolve_gguf(model))["attention.sliding_window"] and SWA_FULL not in extra_args:
            extra_args = (SWA_FULL, *extra_args)  # or llama-server prefills a restored sliding-window slot again
        owned = slot_dir is None
        if slot_dir is None:
            shm = Path("/dev/shm")
            slot_dir = Path(tempfile.mkdtemp(prefix="kvstash-slots-", dir=shm if shm.is_dir() else None))
        slot_dir.mkdir(parents=True, exist_ok=True)
        proc = LlamaServerProcess(resolve_gguf(model), slot_dir, parallel=parallel, ctx_per_slot=ctx_per_slot,
                                  threads=threads, binary=binary, extra_args=extra_args, api_key=api_key)
        proc.start()
        try:
            engine = cls(proc.url, slot_dir, model, reuse_slots=reuse_slots, process=proc, api_key=api_key)
        except BaseException:
            proc.stop()
            if owned:
                shutil.rmtree(slot_dir, ignore_errors=True)
            raise
        engine.owns_slot_dir = owned
        return engine

    # -- start-up check --------------------------------------------------------------------------
    def _probe_layout(self) -> llamastate.StateGeometry:
        """Complete two tokens in slot 0, save it and read the file back: the running llama-server must
        save the layout kvstash reads and restore what kvstash writes, or the sidecar refuses to start."""
        ids = self._tokenize("Hello", special=False)[:2] or [0]
        name = f"{self._prefix}-probe.bin"
        path = self.slot_dir / name
        try:
            self._json("POST", "/completion", {"prompt": ids, "n_predict": 2, "id_slot": 0, "cache_prompt": True,
                                               "temperature": 0.0})
            self._slot_action(0, "save", name)
            data = path.read_bytes()
            state = slotfile.state_of(data)
            self.layout = layout = self._layout(state)
            if not layout.full_attention_only:
                data = data[:len(data) - len(state) + self._attention_only(layout, state)]
            facts = slotfile.facts(data)
            g = self.geometry
            if facts.num_layers != g.num_layers or facts.row_elements != g.kv_heads * g.head_dim:
                raise llamastate.StateLayoutError(f"state of {facts.num_layers} layers x {facts.row_elements}, "
                                                  f"model {g.num_layers} x {g.kv_heads * g.head_dim}")
            geo = llamastate.StateGeometry(g.num_layers, g.kv_heads, g.head_dim, facts.v_trans, facts.n_stream,
                                           facts.kv_type)
            if facts.kv_type != llamastate.GGML_TYPE_F16:  # --cache-type-k/v q8_0: parsed into float32, exactly
                self.geometry = replace(g, dtype=geo.dtype)
            saved = slotfile.parse(data, geo)
            if b"".join(bytes(p) for p in slotfile.assemble(saved.tokens, saved.kv, geo)) != data:
                raise llamastate.StateLayoutError("a re-assembled slot file differs from llama-server's")
            restored = self._slot_action(0, "restore", name)
            if int(restored.get("n_restored", -1)) != len(saved.tokens):
                raise llamastate.StateLayoutError(f"restore of the probe gave {restored}")
        except (llamastate.StateLayoutError, UpstreamError, OSError, httpx.HTTPError) as exc:
            raise ConfigError(f"llama-server at {self.url} ({self.build_info or 'unknown build'}) cannot share KV "
                              f"with kvstash: {exc}") from None
        finally:
            path.unlink(missing_ok=True)
            self._erase(0)
        if self.boundary_records:
            self._probe_reuse(ids)
        return geo

    def _attention_only(self, layout: statelayout.ModelLayout, state: bytearray) -> int:
        """For a sliding-window or hybrid model: where its state's full-attention KV ends (what blocks hold; its
        boundary records hold the rest), its geometry that of those layers alone; a one-line refusal for a layout
        with no full-attention layers of one width."""
        self._section_kinds = tuple(statelayout.KV if isinstance(s, statelayout.KvSection) else statelayout.RECURRENT
                                    for s in statelayout.infer_sections(state))
        rows = set(layout.kv_row_bytes[:layout.full])
        if layout.full == 0 or len(rows) != 1 or self._section_kinds[0] != statelayout.KV:
            raise ConfigError(f"llama-server at {self.url} serves {self.path.name}, {layout.describe()}; kvstash "
                              "caches models with full-attention layers of one width beside their sliding-window or "
                              "recurrent layers")
        g = self.geometry
        self.geometry = replace(g, num_layers=layout.full, kv_heads=rows.pop() // 2 // g.head_dim)
        self.boundary_records = True
        return boundarystate.split_state(state, self._section_kinds)[0]

    def _probe_reuse(self, ids: list[int]) -> None:
        """A sliding-window or hybrid slot restored from a file must be reused, not prefilled again: complete a
        prompt longer than the window, save the slot, restore it, and check llama-server's `cache_n` when the prompt
        goes on; a one-line refusal naming the setting otherwise (llama-server needs `--swa-full`)."""
        prompt = (ids * (2 * self.layout.n_swa // max(1, len(ids)) + 8))[:max(2 * self.layout.n_swa, 16)]
        name = f"{self._prefix}-reuse.bin"
        path = self.slot_dir / name
        try:
            self._json("POST", "/completion", {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True,
                                               "temperature": 0.0})
            saved = int(self._slot_action(0, "save", name).get("n_saved", 0))
            self._erase(0)
            restored = int(self._slot_action(0, "restore", name).get("n_restored", -1))
            reply = self._json("POST", "/completion", {"prompt": prompt + ids[:1] * 4, "n_predict": 1, "id_slot": 0,
                                                       "cache_prompt": True, "temperature": 0.0})
            reused = int((reply.get("timings") or {}).get("cache_n", 0))
        except (UpstreamError, OSError, httpx.HTTPError) as exc:
            raise ConfigError(f"llama-server at {self.url} cannot share {self.path.name}'s KV with kvstash: "
                              f"{exc}") from None
        finally:
            path.unlink(missing_ok=True)
            self._erase(0)
        if restored != saved or reused < min(saved, len(prompt)) - 1:
            raise ConfigError(f"llama-server at {self.url} prefills a restored slot of {self.path.name} again "
                              f"({reused} of {saved} tokens reused): start it with {SWA_FULL} "
                              "(`kvstash sidecar --spawn` does)")

    def boundary_problem(self, state: bytes, position: int) -> str | None:
        """Why a boundary state read back from Redis (untrusted) cannot resume a slot at `position`, or None."""
        return boundarystate.check_boundary(state, self.layout, position, self.state_geometry.v_trans)

    def context_for(self, tokens: int) -> Array | None:
        """As `LendsStates.context_for`; None for a sliding-window or hybrid model (its slot file is assembled from
        its blocks and its boundary record)."""
        return None if self.boundary_records else super().context_for(tokens)

    def _layout(self, state: bytearray) -> statelayout.ModelLayout:
        """Which layers of the served model keep full-attention KV, a sliding window or a recurrent state, from the
        sections of a saved slot's state and the GGUF's header (`LlamaCppEngine._probe_model_layout`'s facts)."""
        facts = gguf_facts(self.path)
        arch, n_layer = facts["arch"], int(facts["block_count"])
        sections = statelayout.infer_sections(state)
        n_swa = int(facts["attention.sliding_window"] or 0) if len(sections) > 1 and isinstance(
            sections[1], statelayout.KvSection) else 0
        sliding = statelayout.sliding_layers(arch, n_layer, facts["attention.sliding_window_pattern"]) if n_swa else ()
        hybrid = isinstance(sections[-1], statelayout.RecurrentSection)
        recurrent = (tuple(range(n_layer)) if len(sections) == 1 else statelayout.recurrent_layers(
            n_layer, facts["attention.head_count_kv"])) if hybrid else ()
        return statelayout.model_layout(arch, n_layer, n_swa, sections, sliding, recurrent)

    # -- identity and text -----------------------------------------------------------------------
    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        engine_id = (f"llama-server/state-v{llamastate.LAYOUT_VERSION}"
                     + llamastate.cache_tag(self.state_geometry.kv_type) + self.kv_layout.tag)
        return gguf_fingerprint(engine_id, self._digest, self._template, self._bos is not None, self.geometry,
                                block_tokens, codec_name)

    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        """Rendered by llama-server's own template (`/apply-template`): an assistant turn of `tool_calls` with null
        content and the tool results after it as llama-server renders them (with `--jinja`). `tools` are refused:
        this engine generates through `/completion`, whose reply llama-server does not parse for calls (the
        sidecar's pass-through chat route does)."""
        if tools:
            raise ParamError("tools: the sidecar engine does not honour them here; send them to /v1/chat/completions",
                             "tools")

        def render(marked: list[dict[str, Any]]) -> str:
            try:
                return str(self._json("POST", "/apply-template", {"messages": marked})["prompt"])
            except UpstreamError as exc:  # llama-server refused the conversation (a template that cannot render it)
                raise ParamError(f"messages: llama-server cannot render this conversation: {exc}", "messages") from None

        ids = chat_token_ids(messages, render, lambda t: self._tokenize(t, special=True), self.text_ids, known)
        if self._bos is not None and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)
        return ids

    def text_ids(self, text: str) -> list[int]:
        return self._tokenize(text, special=False)

    def prompt_ids(self, text: str) -> list[int]:
        return self._tokenize(text, special=False, add_special=True)  # BOS as its completions add it; no specials

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._json("POST", "/detokenize", {"tokens": [int(i) for i in ids]})["content"])

    def count_bypass(self, why: str) -> None:
        self.stats.bypassed[why] = self.stats.bypassed.get(why, 0) + 1

    def close(self) -> None:
        self._http.close()
        if self.process is not None:
            self.process.stop()
        if self.owns_slot_dir:
            shutil.rmtree(self.slot_dir, ignore_errors=True)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, request: GenRequest) -> Generation:
        """`on_prefill` is never called: llama-server hands a slot's KV out only once the slot is idle, so
        the prompt's blocks are written with the reply's, after the last token."""
        prompt_ids, cached_kv, params = request.prompt_ids, request.cached_kv, request.params
        on_text, kv_ready = request.on_text, request.kv_ready
        keep_from, boundary = request.keep_from, request.boundary
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.geometry.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.geometry.max_context}")
        started = time.perf_counter()
        lease = self.lease(prompt, cached_kv, kv_ready, boundary=boundary)
        try:
            reply = self._complete(lease.slot, prompt, params, on_text, started)
        except BaseException:
            self.abandon(lease)
            raise
        reused = int(reply.timings.get("cache_n", 0))
        saved = self.finish(lease, reused, keep_from)
        kv_from = 0
        if saved is None:  # no KV to write back: an empty sequence writes nothing
            seq_ids: list[int] = []
            kv = self.no_kv()
        else:
            seq_ids, kv, kv_from = saved.tokens, saved.kv, saved.kv_from
        return Generation(
            boundaries=((len(seq_ids), saved.boundary),) if saved is not None and saved.boundary else (),
            text=reply.text, token_ids=reply.tokens, finish_reason=reply.finish, prompt_tokens=len(prompt),
            cached_tokens=reused, ttft_s=reply.ttft_s, total_s=time.perf_counter() - started, seq_ids=seq_ids,
            kv=kv, reply_ids=reply_ids(reply.tokens, reply.stop_type == "eos", reply.stop_type == "word"),
            kv_from=kv_from,
        )

    def no_kv(self) -> Array:
        """The KV of an empty sequence [layers, 2, kv_heads, 0, head_dim]: what a request that saved nothing writes."""
        g = self.geometry
        return np.empty((g.num_layers, 2, g.kv_heads, 0, g.head_dim), dtype=np.float16)
