"""Constrained decoding for `response_format` and forced tool calls: a grammar masks every token that would break
the JSON (or the `<tool_call>` blocks) asked for.

hf: llguidance (a library made for it; the tokenizer's vocabulary is read once per engine). llamacpp: llama.cpp's own
grammar sampler, from a GBNF that llama-cpp-python's converter writes for the schema (`json_schema_to_gbnf`), or its
JSON grammar for `json_object`. Either masks the scores a `Sampler` chooses from; neither touches the KV.
"""

from __future__ import annotations

import ctypes
import json
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from service.engines.generation import ParamError, ResponseFormat
from service.engines.tools import CALL_CLOSE, CALL_OPEN

if TYPE_CHECKING:  # the guides mask an engine's torch logits; parsing a request needs no torch
    import torch

ANY_OBJECT = '{"type": "object"}'
# compact JSON: a model may not pad the reply with whitespace until max_tokens runs out
_COMPACT = {"whitespace_flexible": False}


def llg_grammar(fmt: ResponseFormat) -> str:
    """llguidance's grammar for `fmt`; a ParamError (a 400 naming `fmt.param`) when the schema is not one."""
    import llguidance  # noqa: PLC0415

    try:
        if fmt.calls:
            grammar = llguidance.LLMatcher.grammar_from_lark(_calls_lark(fmt))
        else:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(fmt.schema or ANY_OBJECT, overrides=_COMPACT)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ParamError(f"{fmt.param}: the JSON schema is not usable: {exc}", fmt.param) from None
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ParamError(f"{fmt.param}: the JSON schema is not usable: {problem}", fmt.param)
    return str(grammar)


def _calls_lark(fmt: ResponseFormat) -> str:
    """llguidance's (Lark) grammar of a forced tool call: `<tool_call>` blocks around JSON of the call schema."""
    schema = {**json.loads(fmt.schema or ANY_OBJECT), "x-guidance": _COMPACT}
    repeat = ' ("\\n" call)*' if fmt.calls > 1 else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")


class LlgGuide:
    """llguidance's matcher over a transformers tokenizer's vocabulary."""

    def __init__(self, tokenizer: Any, fmt: ResponseFormat, vocab_size: int) -> None:
        import llguidance  # noqa: PLC0415

        self._matcher = llguidance.LLMatcher(tokenizer, llg_grammar(fmt), log_level=0)
        if self._matcher.is_error():
            raise ParamError(f"{fmt.param}: {self._matcher.get_error()}", fmt.param)
        self._vocab = vocab_size
        self._words = np.full((vocab_size + 31) // 32, -1, dtype=np.int32)  # one bit per token: 1 = allowed

    def mask(self, scores: torch.Tensor) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        import torch  # noqa: PLC0415 - only an engine that samples torch logits masks them

        scores[: self._vocab][torch.from_numpy(~allowed).to(scores.device)] = float("-inf")
        scores[self._vocab:] = float("-inf")

    def accept(self, token: int) -> bool:
        self._matcher.consume_token(token)
        return bool(self._matcher.is_stopped() or self._matcher.is_error())


def llg_tokenizer(hf_tokenizer: Any, end_ids: frozenset[int]) -> Any:
    """llguidance's view of a transformers fast tokenizer (about a second to build: once per engine)."""
    import llguidance.hf  # noqa: PLC0415

    eos = hf_tokenizer.eos_token_id
    return llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos if isinstance(eos, int) else sorted(end_ids)[0])


def gbnf(fmt: ResponseFormat) -> str:
    """llama.cpp's grammar (GBNF) for `fmt`: its JSON grammar, or llama-cpp-python's conversion of the schema."""
    from llama_cpp import llama_grammar  # noqa: PLC0415

    if fmt.schema is None:
        return str(llama_grammar.JSON_GBNF)
    try:
        # a call names its function before the arguments (the converter orders other properties by name)
        order = ["name", "arguments"] if fmt.calls else None
        grammar = str(llama_grammar.json_schema_to_gbnf(fmt.schema, prop_order=order))
        # the pinned converter lets a string hold raw control characters (a newline), which JSON forbids: the rule
        # llama.cpp's own converter writes
        grammar = grammar.replace('char ::= [^"\\\\]', 'char ::= [^"\\\\\\x7F\\x00-\\x1F]')
    except (ValueError, KeyError, TypeError, RecursionError, NotImplementedError) as exc:
        raise ParamError(f"{fmt.param}: llama.cpp cannot write a grammar for this schema: {exc}",
                         fmt.param) from None
    if not fmt.calls:
        return grammar
    # the schema's grammar becomes one rule of the call's: `<tool_call>` blocks around it
    body = re.sub(r"^root ::=", "kvstash-call-json ::=", grammar, flags=re.MULTILINE)
    repeat = ' ("\\n" kvstash-call)*' if fmt.calls > 1 else ""
    return (f"root ::= kvstash-call{repeat}\n"
            f"kvstash-call ::= {json.dumps(CALL_OPEN)} kvstash-call-json {json.dumps(CALL_CLOSE)}\n{body}")


class GbnfGuide:
    """llama.cpp's grammar sampler, applied to the scores of the whole vocabulary every step."""

    def __init__(self, lib: Any, vocab: Any, fmt: ResponseFormat, n_vocab: int) -> None:
        self._lib = lib
        self._sampler = lib.llama_sampler_init_grammar(vocab, gbnf(fmt).encode(), b"root")
        if not self._sampler:
            raise ParamError(f"{fmt.param}: llama.cpp refused the grammar of this schema", fmt.param)
        self._cells = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._cells["id"] = np.arange(n_vocab, dtype=np.int32)
        self._array = lib.llama_token_data_array(
            data=self._cells.ctypes.data_as(ctypes.POINTER(lib.llama_token_data)), size=n_vocab, selected=-1,
            sorted=False)

    def mask(self, scores: torch.Tensor) -> None:
        n = self._cells.shape[0]
        self._cells["logit"] = scores[:n].numpy()
        self._array.size, self._array.selected, self._array.sorted = n, -1, False
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        # the grammar sampler keeps the order and sets what it forbids to -inf
        import torch  # noqa: PLC0415 - only an engine that samples torch logits masks them

        scores[:n] = torch.from_numpy(np.ascontiguousarray(self._cells["logit"]))

    def accept(self, token: int) -> bool:
        self._lib.llama_sampler_accept(self._sampler, token)
        return False  # the grammar lets the end-of-generation token through once the JSON is complete

    def close(self) -> None:
        if self._sampler:
            self._lib.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()


def schema_text(schema: Any) -> str:
    """A schema as canonical JSON text (what ResponseFormat holds)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))
