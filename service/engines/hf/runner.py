"""The generation runner: rehydrate a cached prefix, prefill the rest, decode token by token."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.engines.chat import chat_token_ids, remap_known
from service.engines.gate import LayerGate
from service.engines.generation import (
    END_TOKENS,
    Choice,
    Generation,
    GenParams,
    GenRequest,
    PrefillHook,
    TextStream,
    reply_ids,
)
from service.engines.guides import LlgGuide, llg_tokenizer
from service.engines.hf import boundarycache, hfcache
from service.engines.hf.models import LoadedModel
from service.engines.sampling import Sampler
from service.engines.tools import for_template, text_stream

__all__ = ["GenParams", "Generation", "Live", "ModelRunner"]

def _copy_out(cache: object, start: int, end: int, which: Sequence[int] | None) -> torch.Tensor:
    """Tokens [start, end) of the cache's layers `which` (all: None) as a normal (not inference-mode) CPU tensor."""
    with torch.inference_mode(False), torch.no_grad():
        return hfcache.tensor_from_cache(cache, start, end, which)  # type: ignore[arg-type]


@dataclass
class _Decoded:
    """One choice decoded after the prompt."""

    stream: TextStream
    generated: list[int]
    finish: str
    ended_by_token: bool
    cut_by_stop: bool
    sampler: Sampler


@dataclass
class Live:
    """One generation decoded beside others (ModelRunner.begin): its sequence's own cache and its choice so far."""

    prompt: list[int]
    cache: Any
    out: _Decoded
    max_new: int
    cached: int
    started: float
    keep_from: int
    on_prefill: PrefillHook | None = None
    fed: int = 0  # prompt tokens in the cache
    prompt_state: bytes = b""  # the boundary state at the prompt's end (a sliding-window or hybrid model's)
    ttft: float = 0.0
    done: bool = False


class ModelRunner:
    """Runs generations on a loaded model, one at a time (`generate`) or decoded together (`begin`, `step`,
    `take`, `finish`: batch.py); synchronous, not thread-safe."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_context = loaded.max_context
        self.layout = loaded.layout
        # the layers of the blocks (None: all of them), the rest kept as boundary states (boundarycache)
        self.full: tuple[int, ...] | None = loaded.layout.full if loaded.layout.boundary_records else None
        self.end_ids = self._end_ids()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        tok = self.tokenizer
        self.specials = frozenset(str(t) for t in tok.all_special_tokens) | frozenset(
            str(t.content) for t in tok.added_tokens_decoder.values() if t.special)
        self._llg: Any = None  # llguidance's view of the vocabulary, built on the first response_format

    def _guide(self, params: GenParams) -> LlgGuide | None:
        if params.response_format is None:
            return None
        if self._llg is None:
            self._llg = llg_tokenizer(self.tokenizer, self.end_ids)
        return LlgGuide(self._llg, params.response_format, self.vocab_size)

    def token_text(self, token: int) -> tuple[str, bytes]:
        text = str(self.tokenizer.decode([token], skip_special_tokens=False))
        return text, text.encode("utf-8")

    def _end_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[token] for token in END_TOKENS if token in vocab)
        return frozenset(ids)

    def chat_ids(self, messages: list[dict[str, Any]], known: Mapping[int, list[int]] | None = None,
                 tools: tuple[dict[str, Any], ...] | None = None) -> list[int]:
        """Token ids of a chat, ending with the assistant generation prompt; message content is plain
        text (a special token typed by a user stays text), only the template makes special tokens. Tools and
        tool calls: service.engines.tools."""
        template = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else ""
        rendered, native, moved = for_template(messages, tools, template, self.specials)

        def render(marked: list[dict[str, Any]]) -> str:
            return str(self.tokenizer.apply_chat_template(marked, tools=native, add_generation_prompt=True,
                                                          tokenize=False))

        def template_ids(text: str) -> list[int]:
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

        return chat_token_ids(rendered, render, template_ids, self.text_ids, remap_known(known, moved))

    def text_ids(self, text: str) -> list[int]:
        """Plain text: special-token strings in it are split like any other text."""
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _check_kv(self, kv: torch.Tensor, prompt_len: int) -> None:
        m = self.loaded
        want = (m.num_layers, 2, m.kv_heads)
        if kv.dim() != hfcache.KV_DIMS or tuple(kv.shape[:3]) != want or kv.shape[4] != m.head_dim:
            raise ValueError(f"cached kv {tuple(kv.shape)} does not fit the model {want + ('T', m.head_dim)}")
        if kv.shape[3] > prompt_len:
            raise ValueError(f"cached kv covers {kv.shape[3]} tokens, the prompt has {prompt_len}")

    def generate(self, request: GenRequest) -> Generation:
        """Generate after `prompt_ids`, reusing `cached_kv` for prompt_ids[:n] (n = its token count); a layer of
        it is read only once `kv_ready` (if given) says it is in place. The returned KV starts at token
        `keep_from` (the copy out of the cache is the step's largest after the forward: 94 MB at 2k tokens).
        A sliding-window or hybrid model resumes with `boundary`, its boundary state at cached_kv's end."""
        prompt_ids, cached_kv, params = request.prompt_ids, request.cached_kv, request.params
        on_text, on_prefill, kv_ready = request.on_text, request.on_prefill, request.kv_ready
        keep_from, boundary = request.keep_from, request.boundary
        started = time.perf_counter()
        prompt, max_new, cached = self._prepare(prompt_ids, cached_kv, params, boundary)
        ttft = 0.0
        with torch.inference_mode():
            after_prompt, cache = self._prefill(prompt, cached_kv, cached, kv_ready, boundary)
            prompt_state = self._state(cache, len(prompt))
            decoded: dict[int, _Decoded] = {}
            # choice 0 last: the cache then holds its sequence, the one written back
            for choice in [*range(1, params.n), 0]:
                extra = hfcache.cache_length(cache) - len(prompt)
                if decoded and extra > 0:  # back to the prompt alone: every choice is sampled after it
                    self._rewind(cache, extra, prompt_state, len(prompt))
                first = not decoded

                def on_first(cache: object = cache, first: bool = first) -> None:
                    nonlocal ttft
                    if first:
                        ttft = time.perf_counter() - started
                        if on_prefill is not None:  # after the first token: not in its TTFT
                            on_prefill(lambda start, end, cache=cache: _copy_out(cache, start, end, self.full))

                stream = text_stream(self.tokenizer, params, on_text if choice == 0 else None)
                decoded[choice], cache = self._decode(after_prompt, cache, prompt, params, choice, stream, max_new,
                                                      on_first)
        return self._generation(prompt, cached, cache, decoded, ttft, started, keep_from, prompt_state)

    def _state(self, cache: Any, position: int) -> bytes:
        """The boundary state of `cache` at `position` (b"" for a model of full-attention layers only)."""
        if self.full is None:
            return b""
        return boundarycache.read_state(cache, self.layout, position, self.loaded.dtype)

    def _rewind(self, cache: Any, extra: int, prompt_state: bytes, prompt_len: int) -> None:
        """Back to the prompt alone: its last `extra` tokens dropped (a sliding-window or linear layer, which cannot
        drop tokens, is set to the prompt's boundary state)."""
        if self.full is None:
            cache.crop(-extra)  # transformers 5: a negative count of tokens to drop
            return
        for i in self.full:
            cache.layers[i].crop(-extra)
        boundarycache.put_state(cache, self.layout, prompt_state, prompt_len, self.loaded.dtype, self.loaded.device)

    def _restored(self, cached_kv: torch.Tensor, cached: int, kv_ready: LayerGate | None,
                  boundary: bytes | None) -> Any:
        """The cache of the first `cached` tokens: their full-attention KV, and the boundary state at `cached`."""
        cache = hfcache.cache_from_tensor(cached_kv[:, :, :, :cached], self.model, ready=kv_ready, layers=self.full)
        if self.full is not None and boundary is not None:
            try:
                boundarycache.put_state(cache, self.layout, boundary, cached, self.loaded.dtype, self.loaded.device)
            except boundarycache.StateError as exc:
                raise ValueError(f"boundary state: {exc}") from None
        return cache

    def _prepare(self, prompt_ids: list[int], cached_kv: torch.Tensor | None, params: GenParams,
                 boundary: bytes | None = None) -> tuple[list[int], int, int]:
        """The prompt checked, the most tokens the reply may have, and how many prompt tokens `cached_kv` serves."""
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        if len(prompt) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.max_context}")
        max_new = min(params.max_tokens, self.max_context - len(prompt))
        cached = 0
        if boundary is not None and self.full is None:
            raise ValueError("this model keeps full-attention layers only: it resumes at no boundary record")
        if cached_kv is not None:
            self._check_kv(cached_kv, len(prompt))
            # Stored KV carries no logits: the last prompt token is always re-fed.
            cached = min(int(cached_kv.shape[3]), len(prompt) - 1)
            if self.full is not None and cached and (boundary is None or cached != cached_kv.shape[3]):
                raise ValueError("a sliding-window or hybrid model resumes at a boundary: its state and the KV "
                                 "of every token before it")
        return prompt, max_new, cached

    def _prefill(self, prompt: list[int], cached_kv: torch.Tensor | None, cached: int,
                 kv_ready: LayerGate | None, boundary: bytes | None) -> tuple[torch.Tensor, Any]:
        """The logits [vocab] after the prompt and the cache holding it (in inference mode)."""
        cache = None
        if cached:
            assert cached_kv is not None
            cache = self._restored(cached_kv, cached, kv_ready, boundary)
        logits, cache = hfcache.forward(self.model, prompt[cached:], cache)
        return logits[-1], cache

    def _generation(self, prompt: list[int], cached: int, cache: Any, decoded: dict[int, _Decoded], ttft: float,
                    started: float, keep_from: int, prompt_state: bytes) -> Generation:
        """The Generation of `decoded` choices (0 is the main one, whose sequence `cache` holds)."""
        main = decoded[0]
        generated, stream = main.generated, main.stream
        seq_ids = prompt + generated[:-1]  # the last generated token was never fed
        kv_from = min(max(0, keep_from), len(seq_ids))
        with torch.no_grad():  # a normal (not inference-mode) tensor, safe for in-place codec ops
            kv = hfcache.tensor_from_cache(cache, kv_from, len(seq_ids), self.full)
        boundaries: tuple[tuple[int, bytes], ...] = ()
        if prompt_state:  # at the prompt's end and the sequence's (the same when one token was generated)
            boundaries = ((len(prompt), prompt_state),)
            if len(seq_ids) > len(prompt):
                boundaries += ((len(seq_ids), self._state(cache, len(seq_ids))),)
        return Generation(
            text=stream.text,
            token_ids=generated,
            finish_reason=main.finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            ttft_s=ttft,
            total_s=time.perf_counter() - started,
            seq_ids=seq_ids,
            kv=kv,
            reply_ids=reply_ids(generated, main.ended_by_token, main.cut_by_stop),
            kv_from=kv_from,
            logprobs=main.sampler.logprobs,
            choices=[Choice(d.stream.text, d.generated, d.finish, d.sampler.logprobs)
                     for i, d in sorted(decoded.items()) if i],
            boundaries=boundaries,
        )

    def _decode(
        self, logits: torch.Tensor, cache: Any, prompt: list[int], params: GenParams, choice: int,
        stream: TextStream, max_new: int, on_first: Callable[[], None],
    ) -> tuple[_Decoded, Any]:
        """Sample one choice after the prompt's last logits [vocab], feeding each token but the last."""
        sampler = Sampler(params, prompt, choice=choice, guide=self._guide(params), token_text=self.token_text,
                          device=self.loaded.device)
        out = _Decoded(stream, [], "length", False, False, sampler)
        while True:
            token = sampler.next(logits)
            if self._accept(out, token, max_new, on_first):
                break
            step, cache = hfcache.forward(self.model, [token], cache)
            logits = step[-1]
        stream.finish()
        return out, cache

    def _accept(self, out: _Decoded, token: int, max_new: int, on_first: Callable[[], None] | None) -> bool:
        """Append the sampled `token` to `out` (`on_first` after the first); True when it ends the choice."""
        out.generated.append(token)
        if len(out.generated) == 1 and on_first is not None:
            on_first()
        if token in self.end_ids:
            out.finish, out.ended_by_token = "stop", True
            out.sampler.drop_last_logprob()
            return True
        if out.stream.push(token):
            out.finish, out.cut_by_stop = "stop", True
            return True
        if out.sampler.done(token):  # the grammar is complete: the reply is the JSON asked for
            out.finish = "stop"
            return True
        return len(out.generated) >= max_new

    # -- decoded beside others (batch.py): set up, its prompt fed a chunk at a time, then a token a step ------------
    def begin(self, request: GenRequest) -> Live:
        """A one-choice generation set up as `generate` does it (its cached prefix in its cache); `prefill` feeds its
        prompt a chunk at a time until its first token is sampled, `step` and `take` decode the rest beside other
        sequences, `finish` makes its Generation."""
        prompt_ids, cached_kv, params = request.prompt_ids, request.cached_kv, request.params
        on_text, on_prefill, kv_ready = request.on_text, request.on_prefill, request.kv_ready
        keep_from, boundary = request.keep_from, request.boundary
        if params.n != 1:
            raise ValueError("a batched generation samples one choice")
        started = time.perf_counter()
        prompt, max_new, cached = self._prepare(prompt_ids, cached_kv, params, boundary)
        cache = None
        if cached:
            assert cached_kv is not None
            with torch.inference_mode():
                cache = self._restored(cached_kv, cached, kv_ready, boundary)
        sampler = Sampler(params, prompt, choice=0, guide=self._guide(params), token_text=self.token_text,
                          device=self.loaded.device)
        return Live(prompt, cache, _Decoded(text_stream(self.tokenizer, params, on_text), [], "length", False,
                                            False, sampler), max_new, cached, started, keep_from, on_prefill,
                    fed=cached)

    def prefill(self, live: Live, tokens: int) -> bool:
        """Feed up to `tokens` more of `live`'s prompt; True once it is all in and the first token taken."""
        end = min(len(live.prompt), live.fed + max(1, tokens))
        with torch.inference_mode():
            logits, live.cache = hfcache.forward(self.model, live.prompt[live.fed:end], live.cache)
        live.fed = end
        if end < len(live.prompt):
            return False
        live.prompt_state = self._state(live.cache, end)

        def on_first() -> None:
            live.ttft = time.perf_counter() - live.started
            if live.on_prefill is not None:  # after the first token: not in its TTFT
                cache = live.cache
                live.on_prefill(lambda start, stop: _copy_out(cache, start, stop, self.full))

        self._take(live, logits[-1], on_first)
        return True

    def step(self, lives: Sequence[Live]) -> torch.Tensor:
        """One forward step of every sequence in `lives` (none done) on its last token: logits [len(lives), vocab]."""
        with torch.inference_mode():
            return hfcache.forward_rows(self.model, [live.out.generated[-1] for live in lives],
                                        [live.cache for live in lives])

    def take(self, live: Live, logits: torch.Tensor) -> None:
        """Sample `live`'s next token from its row of a step's logits [vocab]."""
        self._take(live, logits, None)

    def _take(self, live: Live, logits: torch.Tensor, on_first: Callable[[], None] | None) -> None:
        live.done = self._accept(live.out, live.out.sampler.next(logits), live.max_new, on_first)
        if live.done:
            live.out.stream.finish()

    def finish(self, live: Live) -> Generation:
        """The Generation of a `live` that is done (its KV copied out of its cache on the calling thread)."""
        return self._generation(live.prompt, live.cached, live.cache, {0: live.out}, live.ttft, live.started,
                                live.keep_from, live.prompt_state)
