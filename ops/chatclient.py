"""A small streaming OpenAI client that measures time to first token (demo and load benchmark)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class TurnResult:
    text: str
    ttft_ms: float
    total_ms: float
    pod: str
    cache: str
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int
    status: int
    prompt_token_ids: list[int] | None = None  # when the request asked for them (return_token_ids)
    upstream: str = ""  # the pod a balancer passed the request to, where it says (X-Kv-Upstream: host:port)


class StreamLost(Exception):
    """A stream that broke after its headers came: the pod that held it (`pod`, `upstream`) is known."""

    def __init__(self, message: str, pod: str, upstream: str) -> None:
        super().__init__(message)
        self.pod, self.upstream = pod, upstream


def stream_chat(
    client: httpx.Client, base_url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> TurnResult:
    """POST a streaming chat request; TTFT is measured at the first content delta. A stream lost after its headers
    raises StreamLost, naming the pod that held it."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    prompt_ids: list[int] | None = None
    with client.stream("POST", base_url + path, json=payload, headers=headers or {}) as resp:
        if resp.status_code != 200:
            resp.read()
            return TurnResult(resp.text, 0.0, (time.perf_counter() - t0) * 1000, resp.headers.get("x-kv-pod", "?"),
                              resp.headers.get("x-kv-cache", "?"), 0, 0, 0, resp.status_code,
                              upstream=_upstream(resp))
        try:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "stream error"))
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    if delta:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        pieces.append(delta)
                if event.get("usage"):
                    usage = event["usage"]
                if isinstance(event.get("prompt_token_ids"), list):
                    prompt_ids = event["prompt_token_ids"]
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            raise StreamLost(f"{type(exc).__name__}: {exc}", resp.headers.get("x-kv-pod", ""),
                             _upstream(resp)) from exc
        total = time.perf_counter() - t0
        return TurnResult(
            text="".join(pieces),
            ttft_ms=(ttft if ttft is not None else total) * 1000,
            total_ms=total * 1000,
            pod=resp.headers.get("x-kv-pod", "?"),
            cache=resp.headers.get("x-kv-cache", "?"),
            cached_tokens=int(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            status=resp.status_code,
            prompt_token_ids=prompt_ids,
            upstream=_upstream(resp),
        )


def _upstream(resp: httpx.Response) -> str:
    """The last pod the balancer tried ("a:1, b:2" after a retry: b:2), or "" where it does not say."""
    return resp.headers.get("x-kv-upstream", "").split(",")[-1].strip()
