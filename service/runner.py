"""The generation runner: rehydrate a cached prefix, prefill the rest, decode token by token."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from service import hfcache
from service.models import LoadedModel

# End-of-turn tokens of common chat templates, honoured when the vocabulary has them.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")


@dataclass(frozen=True)
class GenParams:
    """Sampling settings of one request; temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must lie in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class Generation:
    """The result of one generate call, with the KV the pod writes back to the cache."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float
    seq_ids: list[int]
    kv: torch.Tensor  # [layers, 2, kv_heads, len(seq_ids), head_dim] on CPU


class _TextStream:
    """Incremental detokenization with stop strings: emits only text that is final.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or in a
    prefix of a stop string, so the concatenated deltas always equal the final text.
    """

    def __init__(self, tokenizer: object, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self._tok = tokenizer
        self._stop = stop
        self._on_text = on_text
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` already accounted
        self._read = 0
        self.text = ""  # decoded, complete text so far
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has appeared (text is then cut before it)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._check_stop()

    def _check_stop(self) -> bool:
        if not self._stop:
            self._emit(len(self.text))
            return False
        hits = [i for s in self._stop if (i := self.text.find(s, self._emitted)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self._emit(len(self.text))
            return True
        hold = max((k for s in self._stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        self._emit(len(self.text) - hold)
        return False

    def finish(self) -> None:
        """Flush what was held back for a stop string that never came."""
        self._emit(len(self.text))

    def _emit(self, upto: int) -> None:
        if upto > self._emitted:
            delta = self.text[self._emitted : upto]
            self._emitted = upto
            if self._on_text is not None:
                self._on_text(delta)


class ModelRunner:
    """Runs one generation at a time on a loaded model (synchronous, not thread-safe)."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_context = loaded.max_context
        self.end_ids = self._end_ids()

    def _end_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[token] for token in _END_TOKENS if token in vocab)
        return frozenset(ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, ending with the assistant generation prompt."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(i) for i in out]

    def text_ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

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
    ) -> Generation:
        """Generate after `prompt_ids`, reusing `cached_kv` for prompt_ids[:n] (n = its token count)."""
        started = time.perf_counter()
        prompt = [int(i) for i in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context is {self.max_context}")
        max_new = min(params.max_tokens, self.max_context - len(prompt))
        cached = 0
        if cached_kv is not None:
            self._check_kv(cached_kv, len(prompt))
            # Stored KV carries no logits: the last prompt token is always re-fed.
            cached = min(int(cached_kv.shape[3]), len(prompt) - 1)
        generator = self._generator(params)
        stream = _TextStream(self.tokenizer, params.stop, on_text)
        generated: list[int] = []
        finish = "length"
        ttft = 0.0
        with torch.inference_mode():
            cache = None
            if cached:
                assert cached_kv is not None
                cache = hfcache.cache_from_tensor(cached_kv[:, :, :, :cached], self.model)
            logits, cache = hfcache.forward(self.model, prompt[cached:], cache)
            while True:
                token = self._pick(logits[-1], params, generator)
                if not generated:
                    ttft = time.perf_counter() - started
                generated.append(token)
                if token in self.end_ids:
                    finish = "stop"
                    break
                if stream.push(token):
                    finish = "stop"
                    break
                if len(generated) >= max_new:
                    break
                logits, cache = hfcache.forward(self.model, [token], cache)
        stream.finish()
        seq_ids = prompt + generated[:-1]  # the last generated token was never fed
        with torch.no_grad():  # a normal (not inference-mode) tensor, safe for in-place codec ops
            kv = hfcache.tensor_from_cache(cache, 0, len(seq_ids))
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
        )

    def _generator(self, params: GenParams) -> torch.Generator | None:
        if params.temperature == 0:
            return None
        generator = torch.Generator(device=self.loaded.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        return generator

    @staticmethod
    def _pick(logits: torch.Tensor, params: GenParams, generator: torch.Generator | None) -> int:
        """The next token from last-position logits [vocab]: argmax, or a top-p sample."""
        if params.temperature == 0 or generator is None:
            return int(torch.argmax(logits))
        scores = logits.float()
        # shift first: the top score becomes exactly 0, so a tiny temperature gives -inf, never inf - inf = nan
        # (and float32 has no 1e-300: a temperature that small would divide by zero)
        probs = torch.softmax((scores - scores.max()) / max(params.temperature, 1e-30), dim=-1)
        if params.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (always at least the top token)
            keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < params.top_p
            keep[0] = True  # even when top_p is below float32's smallest number
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=generator))
