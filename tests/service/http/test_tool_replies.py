"""Forced tool calls end: a reply that starts repeating a call ends there, a call repeated word for word is one call,
and a reply cut at max_tokens says `length` and carries no fragment of `<tool_call>` markup."""

from __future__ import annotations

from typing import Any

import torch

from service.engines.generation import Generation, GenParams, ResponseFormat
from service.engines.tools import parse_calls, repeated_call, text_stream
from service.http.params import ToolSpec
from service.http.respond import choices

WEATHER_PARIS = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_OSLO = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class Chars:
    """A detokenizer whose tokens are characters (their code points)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _streamed(text: str, params: GenParams) -> tuple[str, bool]:
    stream = text_stream(Chars(), params, None)
    for ch in text:
        if stream.push(ord(ch)):
            return stream.text, True
    return stream.text, False


def test_a_reply_of_forced_calls_ends_where_it_starts_repeating_one() -> None:
    forced = GenParams(response_format=ResponseFormat(schema=None, calls=2))
    looping = "\n".join([WEATHER_PARIS, WEATHER_OSLO, WEATHER_PARIS, WEATHER_PARIS])
    text, ended = _streamed(looping, forced)
    assert ended and text == WEATHER_PARIS + "\n" + WEATHER_OSLO
    assert repeated_call(WEATHER_PARIS + "\n" + WEATHER_OSLO) is None
    # without forced calls the same text is only text
    assert _streamed(looping, GenParams()) == (looping, False)


def test_a_call_repeated_word_for_word_is_one_call() -> None:
    content, calls = parse_calls("\n".join([WEATHER_PARIS, WEATHER_PARIS, WEATHER_OSLO]))
    assert content is None
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', '{"city": "Oslo"}']


def _reply(text: str, finish: str) -> dict[str, Any]:
    gen = Generation(text=text, token_ids=[1], finish_reason=finish, prompt_tokens=1, cached_tokens=0, ttft_s=0.0,
                     total_s=0.0, seq_ids=[1], kv=torch.empty(0))
    return choices(gen, chat=True, tools=ToolSpec(tools=(), parallel=True))[0]


def test_a_reply_cut_at_max_tokens_says_length_and_drops_the_open_call() -> None:
    cut = _reply(WEATHER_PARIS + '\n<tool_call>\n{"name": "weath', "length")
    assert cut["finish_reason"] == "length"
    assert cut["message"]["content"] is None
    assert [c["function"]["name"] for c in cut["message"]["tool_calls"]] == ["weather"]
    tag_cut = _reply(WEATHER_PARIS + "\n<tool", "length")
    assert tag_cut["message"]["content"] is None and len(tag_cut["message"]["tool_calls"]) == 1
    only_fragment = _reply('<tool_call>\n{"name": "wea', "length")
    assert only_fragment["finish_reason"] == "length"
    assert only_fragment["message"] == {"role": "assistant", "content": None}
    whole = _reply(WEATHER_PARIS, "stop")
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None


def test_a_forced_calls_arguments_hold_only_the_named_properties() -> None:
    """A small model otherwise invents property after property until max_tokens (OpenAI's strict mode and
    llama.cpp's grammars read a tool's parameters so too); a tool that allows more keeps that."""
    from service.engines.tools import call_schema  # noqa: PLC0415

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    closed = call_schema([{"type": "function", "function": {"name": "weather", "parameters": city}}], ["weather"])
    assert closed["properties"]["arguments"] == {**city, "additionalProperties": False}
    open_ = {**city, "additionalProperties": True}
    kept = call_schema([{"type": "function", "function": {"name": "weather", "parameters": open_}}], ["weather"])
    assert kept["properties"]["arguments"] == open_
