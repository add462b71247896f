"""The generation runner: rehydrate a cached prefix, prefill the rest, decode token by token."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.engines.base import PrefillHook
from service.engines.chat import chat_token_ids, remap_known
from service.engines.gate import LayerGate
from service.engines.generation import END_TOKENS, Choice, Generation, GenParams, TextStream, reply_ids
from service.engines.guides import LlgGuide, llg_tokenizer
from service.engines.hf import hfcache
from service.engines.hf.models import LoadedModel
from service.engines.sampling import Sampler
from service.engines.tools import for_template

__all__ = ["GenParams", "Generation", "ModelRunner"]

def _copy_out(cache: object, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of the cache as a normal (not inference-mode) CPU tensor."""
    with torch.inference_mode(False), torch.no_grad():
        return hfcache.tensor_from_cache(cache, start, end)  # type: ignore[arg-type]


@dataclass
class _Decoded:
    """One choice decoded after the prompt."""

    stream: TextStream
    generated: list[int]
    finish: str
    ended_by_token: bool
    cut_by_stop: bool
    sampler: Sampler


class ModelRunner:
    """Runs one generation at a time on a loaded model (synchronous, not thread-safe)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_context = loaded.max_context
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
        """Generate after `prompt_ids`, reusing `cached_kv` for prompt_ids[:n] (n = its token count); a layer of
        it is read only once `kv_ready` (if given) says it is in place. The returned KV starts at token
        `keep_from` (the copy out of the cache is the step's largest after the forward: 94 MB at 2k tokens)."""
        started = time.perf_counter()
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if max(prompt) >= self.vocab_size or min(prompt) < 0:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        if len(prompt) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.max_context}")
        max_new = min(params.max_tokens, self.max_context - len(prompt))
        cached = 0
        if cached_kv is not None:
            self._check_kv(cached_kv, len(prompt))
            # Stored KV carries no logits: the last prompt token is always re-fed.
            cached = min(int(cached_kv.shape[3]), len(prompt) - 1)
        ttft = 0.0
        with torch.inference_mode():
            cache = None
            if cached:
                assert cached_kv is not None
                cache = hfcache.cache_from_tensor(cached_kv[:, :, :, :cached], self.model, ready=kv_ready)
            logits, cache = hfcache.forward(self.model, prompt[cached:], cache)
            after_prompt = logits[-1]
            decoded: dict[int, _Decoded] = {}
            # choice 0 last: the cache then holds its sequence, the one written back
            for choice in [*range(1, params.n), 0]:
                extra = hfcache.cache_length(cache) - len(prompt)
                if decoded and extra > 0:  # back to the prompt alone: every choice is sampled after it
                    cache.crop(-extra)  # transformers 5: a negative count of tokens to drop
                first = not decoded

                def on_first(cache: object = cache, first: bool = first) -> None:
                    nonlocal ttft
                    if first:
                        ttft = time.perf_counter() - started
                        if on_prefill is not None:  # after the first token: not in its TTFT
                            on_prefill(lambda start, end, cache=cache: _copy_out(cache, start, end))

                stream = TextStream(self.tokenizer, params.stop, on_text if choice == 0 else None)
                decoded[choice], cache = self._decode(after_prompt, cache, prompt, params, choice, stream, max_new,
                                                      on_first)
        main = decoded[0]
        generated, stream = main.generated, main.stream
        seq_ids = prompt + generated[:-1]  # the last generated token was never fed
        kv_from = min(max(0, keep_from), len(seq_ids))
        with torch.no_grad():  # a normal (not inference-mode) tensor, safe for in-place codec ops
            kv = hfcache.tensor_from_cache(cache, kv_from, len(seq_ids))
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
            out.generated.append(token)
            if len(out.generated) == 1:
                on_first()
            if token in self.end_ids:
                out.finish, out.ended_by_token = "stop", True
                sampler.drop_last_logprob()
                break
            if stream.push(token):
                out.finish, out.cut_by_stop = "stop", True
                break
            if sampler.done(token):  # the grammar is complete: the reply is the JSON asked for
                out.finish = "stop"
                break
            if len(out.generated) >= max_new:
                break
            step, cache = hfcache.forward(self.model, [token], cache)
            logits = step[-1]
        stream.finish()
        return out, cache
