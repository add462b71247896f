"""Replies of llama-server and of a sidecar in front of it, made comparable: everything but what differs by nature
between two servers (completion and tool-call ids, clocks, the slot that served it)."""

from __future__ import annotations

import json
from typing import Any

import httpx

# "id" is the completion's (and each tool call's) random id; "created" a clock; "id_slot" the slot that served it
VOLATILE = frozenset({"id", "created", "id_slot"})
TIMED = ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
         "predicted_per_second")


def normalized(value: Any) -> Any:
    """`value` without its volatile fields and with llama-server's timings reduced to their token counts."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in VOLATILE:
                continue
            if key == "timings" and isinstance(item, dict):
                out[key] = {k: v for k, v in item.items() if k not in TIMED}
            else:
                out[key] = normalized(item)
        return out
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def events(text: str) -> list[Any]:
    """The events of a server-sent stream, each parsed (JSON, or the raw line as text for [DONE])."""
    out: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[6:]
                out.append(json.loads(payload) if payload.startswith("{") else payload)
    return out


def reply(resp: httpx.Response, stream: bool) -> dict[str, Any]:
    """What a client reads of one reply: its status and its body (each event of a stream), normalized."""
    text = resp.text
    if stream and resp.status_code == 200:
        return {"status": resp.status_code, "events": by_choice(normalized(events(text)))}
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    return {"status": resp.status_code, "body": normalized(body)}


def by_choice(stream: list[Any]) -> dict[str, list[Any]]:
    """A stream's events by the choice they carry, in order (llama-server decodes the choices of `n` in slots of
    its choosing, and sends each slot's events in slot order); events of no choice (usage, [DONE]) apart."""
    out: dict[str, list[Any]] = {}
    for event in stream:
        found = event.get("choices") if isinstance(event, dict) else None
        index = str(found[0].get("index")) if found and isinstance(found[0], dict) else "none"
        out.setdefault(index, []).append(event)
    return out
