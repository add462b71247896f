"""What every engine shares about one generation: its parameters, its result and streamed text (sampling:
service.engines.sampling)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cachestore.codec.arrays import Array

if TYPE_CHECKING:
    from service.engines.gate import LayerGate

# on_prefill(get_kv): get_kv(start, end) -> [layers, 2, kv_heads, end - start, head_dim], a CPU copy; called
# during the hook (llama.cpp's reads a pooled snapshot of the sequence, reused once the hook returns); in the engine's
# own array library (`KvGeometry.dtype`)
PrefillHook = Callable[[Callable[[int, int], Array]], None]

# End-of-turn tokens of common chat templates, honoured when the vocabulary has them.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>")


class ParamError(ValueError):
    """A request parameter the engine cannot honour as given: a 400 that names `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ResponseFormat:
    """A reply constrained to JSON: any JSON object (`schema` None) or one that validates against `schema` (JSON).

    `calls` > 0: a forced tool call (`tool_choice` "required" or a named function): the reply is `<tool_call>` blocks
    (service.engines.tools), each holding JSON that validates against `schema` (the calls it may make); 1 block
    exactly, or with `calls` 2 one or more (`parallel_tool_calls`)."""

    schema: str | None = None
    calls: int = 0

    @property
    def param(self) -> str:
        """The request parameter a grammar that cannot be built is the fault of (the 400 names it)."""
        return "tool_choice" if self.calls else "response_format"


@dataclass(frozen=True)
class GenParams:
    """Sampling settings of one request; temperature 0 means greedy. None of them changes the KV of a token."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1  # choices, each sampled on its own after one prefill
    top_k: int = 0  # 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over the prompt and the reply (transformers' rule)
    presence_penalty: float = 0.0  # over the reply's tokens (OpenAI's rule)
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k most likely
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must lie in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.n < 1 or self.top_k < 0 or not 0 <= self.min_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError("n >= 1, top_k >= 0, 0 <= min_p <= 1 and repetition_penalty > 0")


@dataclass(frozen=True)
class GenRequest:
    """One generation an engine runs (`Engine.generate`): after `prompt_ids`, reusing `cached_kv`
    [layers, 2, kv_heads, n, head_dim] for prompt_ids[:n].

    `on_text` gets the reply's text as it becomes final. `on_prefill` is called once, after the first token, with a
    function that copies out the KV of prompt tokens [start, end) (their blocks are written while the reply is
    generated). `kv_ready`, when given, says which layers of `cached_kv` are in place yet: a `layerwise` engine
    waits for each layer as it reaches it, any other engine for all of them before reading any. The returned KV
    starts at `keep_from` if the engine can copy out less (a hit's cached blocks need no write-back). `boundary`: a
    `boundary_records` engine's boundary state at cached_kv's end (required with `cached_kv`); refused by any
    other engine."""

    prompt_ids: list[int]
    cached_kv: Array | None = None
    params: GenParams = GenParams()
    on_text: Callable[[str], None] | None = None
    on_prefill: PrefillHook | None = None
    kv_ready: LayerGate | None = None
    keep_from: int = 0
    boundary: bytes | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model, and the most likely alternatives (sorted)."""

    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...] = ()


@dataclass
class Choice:
    """A further choice of an `n` > 1 request (the first is the Generation itself)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


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
    kv: Array  # [layers, 2, kv_heads, len(seq_ids) - kv_from, head_dim] on CPU: seq_ids[kv_from:]'s KV
    reply_ids: list[int] | None = None  # ids that decode to exactly `text` (no end-of-turn token); None if cut
    kv_from: int = 0  # the first token `kv` holds (the caller said it needs none before: `keep_from`)
    logprobs: list[TokenLogprob] | None = None  # one per generated token but an ending end-of-turn token
    choices: list[Choice] = field(default_factory=list)  # choices 2..n (their KV is not written back)
    # a sliding-window or hybrid model's boundary states (position P, what a boundary record holds beside the KV of
    # tokens 0..P-1): at the prompt's end and at the sequence's
    boundaries: tuple[tuple[int, bytes], ...] = ()


def reply_ids(generated: list[int], ended_by_token: bool, cut_by_stop: bool) -> list[int] | None:
    """The generated ids of a reply's text: without the end-of-turn token that ended it (the chat template
    writes that one), and None when a stop string cut the text inside the generated tokens."""
    if cut_by_stop:
        return None
    return generated[:-1] if ended_by_token else list(generated)


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class TextStream:
    """Incremental detokenization with stop strings: emits only text that is final.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or in a
    prefix of a stop string, so the concatenated deltas always equal the final text.
    """

    def __init__(self, tokenizer: Detokenizer, stop: tuple[str, ...], on_text: Callable[[str], None] | None,
                 cut: Callable[[str], int | None] | None = None):
        self._tok = tokenizer
        self._stop = stop
        self._cut = cut  # where the text must end, given all of it, or None (forced calls: service.engines.tools)
        self._on_text = on_text
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` already accounted
        self._read = 0
        self.text = ""  # decoded, complete text so far
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string has appeared (text is then cut before it)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        if self._cut is not None and (end := self._cut(self.text)) is not None:
            self.text = self.text[:end]
            self._emit(len(self.text))
            return True
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
