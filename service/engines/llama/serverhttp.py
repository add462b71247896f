"""The llama-server engine's HTTP calls: JSON requests that wait out a restart, and a streamed completion."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from service.engines.base import KvGeometry
from service.engines.generation import GenParams
from service.engines.llama.slots import SlotKeeper, UpstreamError

UPSTREAM_WAIT_S = 60.0  # how long a request waits for a restarting llama-server before it fails


class ServerHttp(SlotKeeper):
    """`LlamaServerEngine`'s requests to its llama-server, on `_http`."""

    _http: httpx.Client
    geometry: KvGeometry

    def _await_upstream(self, why: str) -> None:
        """llama-server is (re)starting: wait, bounded, until it answers /health with 200."""
        deadline = time.monotonic() + UPSTREAM_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self._http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise UpstreamError(f"llama-server did not come back within {UPSTREAM_WAIT_S:.0f} s ({why})")

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            r = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:  # restarted underneath (supervised): wait for it once, then retry
            self._await_upstream(str(exc))
            r = self._http.request(method, path, json=body)
        if r.status_code == 503:  # still loading its model
            self._await_upstream(r.text[:100])
            r = self._http.request(method, path, json=body)
        if r.status_code != 200:
            raise UpstreamError(f"llama-server {method} {path}: HTTP {r.status_code} {r.text[:200]}")
        out: dict[str, Any] = r.json()
        return out

    def _json_list(self, method: str, path: str) -> list[dict[str, Any]]:
        r = self._http.request(method, path)
        if r.status_code != 200:
            raise UpstreamError(f"llama-server {method} {path}: HTTP {r.status_code} {r.text[:200]}")
        out = r.json()
        return [a for a in out if isinstance(a, dict)] if isinstance(out, list) else []

    def _tokenize(self, text: str, *, special: bool, add_special: bool = False) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": special}
        return [int(t) for t in self._json("POST", "/tokenize", body)["tokens"]]

    def _slot_action(self, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
        return self._json("POST", f"/slots/{slot}?action={action}", {"filename": filename} if filename else {})

    def _complete(
        self, slot: int, prompt: list[int], params: GenParams, on_text: Callable[[str], None] | None,
        started: float,
    ) -> _Reply:
        body: dict[str, Any] = {
            "prompt": prompt, "id_slot": slot, "cache_prompt": self.reuse_slots, "stream": True,
            "return_tokens": True, "n_predict": min(params.max_tokens, self.geometry.max_context - len(prompt)),
            "temperature": params.temperature, "top_p": params.top_p, "top_k": 0, "min_p": 0.0,
            "stop": list(params.stop),
        }
        if params.seed is not None:
            body["seed"] = params.seed
        reply = _Reply()
        # a streamed response ends its connection: never hand that connection back to the pool
        with self._http.stream("POST", "/completion", json=body, headers={"Connection": "close"}) as r:
            if r.status_code != 200:
                raise UpstreamError(f"llama-server /completion: HTTP {r.status_code} {r.read()[:200]!r}")
            for event in _events(r.iter_lines()):
                if "error" in event:
                    raise UpstreamError(f"llama-server /completion: {event['error']}")
                if not reply.tokens and event.get("tokens"):
                    reply.ttft_s = time.perf_counter() - started
                reply.tokens += [int(t) for t in event.get("tokens") or ()]
                text = str(event.get("content") or "")
                if text:
                    reply.text += text
                    if on_text is not None:
                        on_text(text)  # raises when the client went away: closing the stream cancels upstream
                if event.get("stop"):
                    reply.timings = dict(event.get("timings") or {})
                    reply.stop_type = str(event.get("stop_type") or "")
                    reply.finish = "length" if reply.stop_type == "limit" else "stop"
        return reply


@dataclass
class _Reply:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish: str = "length"
    stop_type: str = ""  # llama-server's: eos | word | limit
    ttft_s: float = 0.0
    timings: dict[str, Any] = field(default_factory=dict)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (`data: {...}` lines)."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:].strip()
            if payload and payload != "[DONE]":
                yield json.loads(payload)
        elif line.startswith("error: "):
            yield {"error": line[7:]}
