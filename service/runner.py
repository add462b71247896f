"""The generation runner: rehydrate a cached prefix, prefill the rest, decode token by token."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from service import hfcache
from service.engines.base import PrefillHook
from service.engines.chat import chat_token_ids
from service.engines.generation import (
    END_TOKENS,
    Generation,
    GenParams,
    TextStream,
    make_generator,
    pick,
    reply_ids,
)
from service.models import LoadedModel
from service.rehydrate import LayerGate

__all__ = ["GenParams", "Generation", "ModelRunner"]

def _copy_out(cache: object, start: int, end: int) -> torch.Tensor:
    """Tokens [start, end) of the cache as a normal (not inference-mode) CPU tensor."""
    with torch.inference_mode(False), torch.no_grad():
        return hfcache.tensor_from_cache(cache, start, end)  # type: ignore[arg-type]


class ModelRunner:
    """Runs one generation at a time on a loaded model (synchronous, not thread-safe)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_context = loaded.max_context
        self.end_ids = self._end_ids()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])

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

    def chat_ids(self, messages: list[dict[str, str]], known: Mapping[int, list[int]] | None = None) -> list[int]:
        """Token ids of a chat, ending with the assistant generation prompt; message content is plain
        text (a special token typed by a user stays text), only the template makes special tokens."""

        def render(marked: list[dict[str, str]]) -> str:
            return str(self.tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False))

        def template_ids(text: str) -> list[int]:
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

        return chat_token_ids(messages, render, template_ids, self.text_ids, known)

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
        generator = make_generator(params, self.loaded.device)
        stream = TextStream(self.tokenizer, params.stop, on_text)
        generated: list[int] = []
        finish = "length"
        ended_by_token = cut_by_stop = False
        ttft = 0.0
        with torch.inference_mode():
            cache = None
            if cached:
                assert cached_kv is not None
                cache = hfcache.cache_from_tensor(cached_kv[:, :, :, :cached], self.model, ready=kv_ready)
            logits, cache = hfcache.forward(self.model, prompt[cached:], cache)
            while True:
                token = pick(logits[-1], params, generator)
                if not generated:
                    ttft = time.perf_counter() - started
                generated.append(token)
                if on_prefill is not None and len(generated) == 1:  # after the first token: not in its TTFT
                    on_prefill(lambda start, end, cache=cache: _copy_out(cache, start, end))
                if token in self.end_ids:
                    finish, ended_by_token = "stop", True
                    break
                if stream.push(token):
                    finish, cut_by_stop = "stop", True
                    break
                if len(generated) >= max_new:
                    break
                logits, cache = hfcache.forward(self.model, [token], cache)
        stream.finish()
        seq_ids = prompt + generated[:-1]  # the last generated token was never fed
        kv_from = min(max(0, keep_from), len(seq_ids))
        with torch.no_grad():  # a normal (not inference-mode) tensor, safe for in-place codec ops
            kv = hfcache.tensor_from_cache(cache, kv_from, len(seq_ids))
        return Generation(
            text=stream.text,
            token_ids=generated,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            ttft_s=ttft,
            total_s=time.perf_counter() - started,
            seq_ids=seq_ids,
            kv=kv,
            reply_ids=reply_ids(generated, ended_by_token, cut_by_stop),
            kv_from=kv_from,
        )
