"""Test helpers (no tests) for pods and sidecars that leave: streamed completions on threads of their own,
readiness and the next turn of a conversation."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

from ops.pods import PodProcess


@dataclass
class Stream:
    """One streamed completion on a thread of its own: what came back, and when the first token did. A chat of
    `messages`, or with `prompt` a text completion."""

    url: str
    messages: list[dict[str, str]]
    max_tokens: int
    prompt: str | None = None
    first: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # [DONE] arrived
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body: dict[str, Any] = {"model": "smollm2", "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        chat = self.prompt is None
        body.update({"messages": self.messages} if chat else {"prompt": self.prompt})
        route = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            with httpx.stream("POST", self.url + route, json=body, timeout=300) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        for choice in event.get("choices", []):
                            self.text += (choice["delta"].get("content") if chat else choice.get("text")) or ""
                            self.finish_reason = choice.get("finish_reason") or self.finish_reason
                            if self.text:
                                self.first.set()
                        self.usage = event.get("usage") or self.usage
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc
        finally:
            self.first.set()

    def join(self, timeout_s: float = 120.0) -> None:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"


def readyz(url: str) -> int | str:
    """The status /readyz answers, or "closed" when nothing listens any more.

    A connection the kernel accepted just before the listener closed is dropped unanswered: closed too.
    """
    try:
        return httpx.get(url + "/readyz", timeout=10).status_code
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        return "closed"


def next_turn(pod: PodProcess, stream: Stream) -> httpx.Response:
    """`stream`'s conversation, its reply and one more question, sent to `pod` (a pod or a sidecar)."""
    messages = [*stream.messages, {"role": "assistant", "content": stream.text}, {"role": "user", "content": "Why?"}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(pod.url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp
