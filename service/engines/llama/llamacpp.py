"""The `llamacpp` engine: a GGUF model in llama.cpp (llama-cpp-python, pinned), several sequences decoded together.

One llama.cpp context holds `parallel` sequences. A scheduler thread owns it: every step it builds
one batch with the next token of each sequence that is generating and a chunk of the prompt of each
sequence that is prefilling, runs one `llama_decode`, and samples each sequence's next token. A request
that arrives while others generate joins the next step; a finished or abandoned one frees its sequence
at once. Cached KV enters and leaves a sequence as llama.cpp sequence state (service.engines.llama.llamastate).

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

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from cachestore.codec.arrays import Array
from cachestore.errors import ConfigError
from cachestore.hashing import ModelFingerprint
from service.engines import LLAMACPP_MISSING
from service.engines.base import KvGeometry
from service.engines.chat import chat_token_ids, remap_known
from service.engines.generation import (
    Choice,
    Generation,
    GenParams,
    GenRequest,
    TextStream,
    reply_ids,
)
from service.engines.guides import GbnfGuide
from service.engines.llama import PARALLEL, boundarystate, llamastate, statewrite
from service.engines.llama.gguf import (
    FLASH_ATTN,
    check_flash_attn,
    file_digest,
    gguf_fingerprint,
    gguf_rope,
)
from service.engines.llama.lending import LendsStates, StateLender, kv_layout, state_buffers
from service.engines.llama.modelprobe import PINNED_VERSION, ModelProbe
from service.engines.llama.models import resolve_gguf
from service.engines.llama.scheduler import N_BATCH, SeqRequest, StreamClosedError, prefill_chunk
from service.engines.llama.vocab import Vocab, quiet_logs
from service.engines.sampling import Sampler
from service.engines.tools import for_template, text_stream
from service.runtime import threads as torch_threads

log = logging.getLogger("kvstash.llamacpp")

MAX_SEQ_CONTEXT = 8192  # tokens per sequence at most (the model's training context if smaller)


class LlamaCppEngine(ModelProbe, LendsStates):
    """A GGUF model served by llama.cpp with continuous batching over `parallel` sequences."""

    kind = "llamacpp"
    layerwise = False  # a sequence's state is set whole
    runs_torch = False  # llama.cpp computes on its own scheduler thread

    def __init__(self, path: Path, *, name: str, parallel: int = PARALLEL, threads: int = 0, kv_type: str = "f16",
                 flash_attn: str = "auto") -> None:
        # llama.cpp runs its own OpenMP team on the scheduler thread: torch work on the thread that loads (and
        # probes) the engine keeps to one core, or libgomp, with more threads than cores, parks its workers
        # between regions and every decode step pays the wake-ups (service.runtime.threads)
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
        self._log_cb = quiet_logs()
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
        cparams.swa_full = True  # window cells stay in the cells of their positions (boundarystate.with_streams)
        cparams.type_k = cparams.type_v = llamastate.KV_TYPES[kv_type]
        # a quantized V cache needs flash attention (V then kept as rows)
        flash_attn = "on" if kv_type != "f16" else flash_attn
        cparams.flash_attn_type = FLASH_ATTN[flash_attn]
        self.prefill_chunk = prefill_chunk(flash_attn)
        self._long_piece_due = 0.0
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ConfigError(f"llama.cpp could not create a context of {per_seq} x {parallel} tokens")
        self._mem = lib.llama_get_memory(self._ctx)
        self._vocab_p = lib.llama_model_get_vocab(self._model)
        self.vocab = Vocab(lib, self._vocab_p)
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
        # sliding-window and recurrent layers: blocks hold the full-attention layers, boundary records the rest
        self.boundary_records = bool(boundarystate.boundary_kinds(self.layout))
        if self.boundary_records:
            self.geometry = self._attention_geometry(head_dim, per_seq)
        self.state_geometry = self._probe_layout()
        # exact and fp16 frames as token rows, the order the state holds K and V in: a hit lands in the state itself
        self.kv_layout = kv_layout(self.state_geometry, self.layout, gguf_rope(path, head_dim))
        self._digest = file_digest(path)
        self.restore_failures = 0
        self._inbox: queue.Queue[SeqRequest] = queue.Queue()
        self._free = list(range(parallel))
        self._state_buffers = state_buffers(keep=parallel)
        self._snapshots = state_buffers(keep=parallel)  # finished sequences' states, read back for the write-back
        # contexts lent to the pipeline are these states (lending): a q8_0 state has no float view, so a
        # float32 tensor is lent beside it, and rows received into the state (q8 frames) never pass through it
        self._lender = StateLender(self.state_geometry, self.geometry, self._state_buffers, self.kv_layout,
                                   transposed_v=True)
        self._active: list[SeqRequest] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstash-llamacpp", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model: str, *, parallel: int = PARALLEL, threads: int = 0, kv_type: str = "f16",
             flash_attn: str = "auto") -> LlamaCppEngine:
        path = resolve_gguf(model)
        return cls(path, name=model if model == "smollm2" else path.stem, parallel=parallel, threads=threads,
                   kv_type=kv_type, flash_attn=flash_attn)

    def boundary_problem(self, state: bytes, position: int) -> str | None:
        """Why a boundary state read back from Redis (untrusted) cannot resume a sequence at `position`, or None."""
        return boundarystate.check_boundary(state, self.layout, position, self.state_geometry.v_trans)

    def context_for(self, tokens: int) -> Array | None:
        """As `LendsStates.context_for`; None for a sliding-window or hybrid model, whose state is assembled whole
        from its blocks and its boundary record."""
        return None if self.boundary_records else super().context_for(tokens)

    def fingerprint(self, block_tokens: int, codec_name: str) -> ModelFingerprint:
        engine_id = (f"llamacpp-{PINNED_VERSION}/state-v{llamastate.LAYOUT_VERSION}"
                     + llamastate.cache_tag(self.state_geometry.kv_type) + self.kv_layout.tag)
        return gguf_fingerprint(engine_id, self._digest, self._template or "", self._add_bos, self.geometry,
                                block_tokens, codec_name)

    # -- text ------------------------------------------------------------------------------------
    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        if self._template is None:
            raise ConfigError(f"{self.path.name} carries no chat template")
        from service.engines.llama.jinja import render_chat  # noqa: PLC0415

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

    def prompt_ids(self, text: str) -> list[int]:
        """As llama-server tokenizes a completion's prompt, but for special tokens: llama.cpp adds BOS (Gemma's
        add_bos_token), without which a model trained behind one drifts from its first token on."""
        return self.vocab.tokenize(text, special=False, add_special=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self.vocab.decode(list(ids))

    # -- generation (any thread) -----------------------------------------------------------------
    def generate(self, request: GenRequest) -> Generation:
        """The returned KV starts at token `keep_from` (`Generation.kv_from`): only those cells are parsed out of the
        sequence state, which at 2048 tokens saves a 47 MB copy (~20 ms on one core) before the reply returns.
        A sliding-window or hybrid model resumes only with `boundary`, the boundary state at `cached_kv`'s end
        (`boundary_problem` checked), and returns its boundary states at the prompt's end and the sequence's."""
        prompt_ids, cached_kv, params = request.prompt_ids, request.cached_kv, request.params
        on_text, on_prefill, kv_ready = request.on_text, request.on_prefill, request.kv_ready
        keep_from, boundary = request.keep_from, request.boundary
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
            if self.boundary_records and (boundary is None or cached != cached_kv.shape[3]):
                raise ValueError("a sliding-window or hybrid model resumes at a boundary: its state and the KV "
                                 "of every token before it")
            if kv_ready is not None:
                kv_ready.wait_all()  # the state is set whole: every layer first
            lent = self._lent_state(cached_kv, cached)  # the hit was dequantized into a state: set as it is
            state, planned = lent if lent is not None else (None, cached)
            size = llamastate.state_size(planned, self.state_geometry)
            if state is None:
                rest = (boundarystate.with_streams(boundary, self._section_kinds[1:], self.state_geometry.n_stream)
                        if self.boundary_records and boundary is not None else [])
                try:
                    state = statewrite.assemble_state(
                        cached_kv[:, :, :, :cached], self.state_geometry,
                        into=self._state_buffers.take(size + sum(len(piece) for piece in rest)))
                except llamastate.StateLayoutError as exc:
                    raise ValueError(str(exc)) from None
                for piece in rest:  # the window / recurrent state after the full-attention KV
                    state[size:size + len(piece)] = piece
                    size += len(piece)
        max_new = min(params.max_tokens, limit - len(prompt))
        req = SeqRequest(prompt, state, cached, params, on_text, text_stream(self.vocab, params, on_text),
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
            kv_end, at_end = self._split(req.blob)
            if self.boundary_records and (not req.boundaries or req.boundaries[-1][0] != len(seq_ids)):
                req.boundaries.append((len(seq_ids), at_end))
            kv = llamastate.parse_state(req.blob[:kv_end], self.state_geometry, start=kv_from, cells=len(seq_ids))
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
            boundaries=tuple(req.boundaries),
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

    def _extra_choice(self, prompt: list[int], cached_kv: Array | None, cached: int, lent: bool,
                      params: GenParams, choice: int, max_new: int) -> SeqRequest:
        """Choice `choice` (> 0) of an `n` request: the cached prefix set again from `cached_kv` (a context lent as
        a state was set whole by choice 0: this one prefills the prompt), its state never read back."""
        state, size = None, 0
        if cached and cached_kv is not None and not lent and not self.boundary_records:  # else: prefilled
            size = llamastate.state_size(cached, self.state_geometry)
            state = statewrite.assemble_state(cached_kv[:, :, :, :cached], self.state_geometry,
                                              into=self._state_buffers.take(size))
        req = SeqRequest(prompt, state, cached if state is not None else 0, params, None,
                       text_stream(self.vocab, params, None), self._sampler(params, prompt, choice), max_new)
        req.state_size, req.planned, req.keeps_state = size, cached if state is not None else 0, False
        return req

    def _lent_state(self, cached_kv: Array, cached: int) -> tuple[bytearray, int] | None:
        """The state of the context lent `cached_kv` is (`StateLender.take`) and how many cells it holds; None when it
        is no such context, or when setting an F16 state whole would copy more than twice the cells wanted (the cells
        past `cached` are set, then dropped: see `_admit`). A q8_0 state is set whatever its cells: it holds the
        rows."""
        lent = self._lender.take(cached_kv, cached)
        if lent is None or (lent.tensor is None and 2 * cached < lent.cells):
            return None
        self._lender.settle(lent)  # V stored transposed (no flash attention): put in place now
        return lent.state, lent.cells

    def score(self, cached_kv: Array, ids: list[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of `ids` fed after the KV of cached_kv.shape[3] tokens (the quality
        bench: row j predicts ids[j + 1])."""
        n = int(cached_kv.shape[3])
        if n and self.boundary_records:
            raise ValueError("scoring after cached KV needs full-attention layers only")
        state = statewrite.assemble_state(cached_kv, self.state_geometry) if n else None
        prompt = [0] * n + [int(t) for t in ids]  # the cached tokens' ids are not read back
        req = SeqRequest(prompt, state, n, GenParams(max_tokens=1), None, TextStream(self.vocab, (), None), None, 1)
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
