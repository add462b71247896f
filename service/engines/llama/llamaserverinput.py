"""What a request to llama-server asks it to process, as the sidecar's cache sees it: where its prompt comes from,
the identity its KV is computed under, or why it bypasses the cache.

The rule (docs/sidecar.md, "Identity"): a request's KV is shared only with requests whose tokens and identity are
the same. The identity is the model (the GGUF's digest, in the fingerprint), the tenant (its salt) and the LoRA
adapters with their scales. A request whose KV depends on anything else the cache cannot name bypasses it: media
(images, audio: their embeddings are not tokens), several prompts in one request, adapters at the server's global
scales (anyone may change them with POST /lora-adapters between the lookup and the prefill).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHAT_ROUTES = ("/v1/chat/completions", "/chat/completions")
TEXT_ROUTES = ("/v1/completions", "/completions", "/completion")
TEXT_PART = "text"  # a chat content part of any other type (image_url, input_audio, file, ...) is media


@dataclass(frozen=True)
class Plan:
    """How the sidecar serves one completion request."""

    chat: bool
    prompt: Any = None  # text routes: the prompt as llama-server tokenizes it (a string, ids, or both mixed)
    identity: bytes = b""  # what besides the tokens shapes the KV (adapters and scales), folded into the salt
    slots: int = 1  # slots the request occupies: llama-server decodes each of its `n` choices in its own
    stream: bool = False
    bypass: str | None = None  # why the cache is not used (the request goes to llama-server as it is)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _media_in_messages(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != TEXT_PART for p in content):
            return True
    return False


def _single_prompt(prompt: Any) -> tuple[Any, str | None]:
    """The one prompt of a text request as llama-server tokenizes it (`tokenize_input_prompts`), or why not."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list):
        if prompt and any(_is_int(p) for p in prompt):  # ids, or ids and strings mixed: one prompt
            if all(_is_int(p) or isinstance(p, str) for p in prompt):
                return prompt, None
            return None, "prompt"
        if len(prompt) == 1:
            return _single_prompt(prompt[0])
        return None, "prompts"  # several prompts (or none): llama-server runs one task for each
    if isinstance(prompt, dict):
        if "multimodal_data" in prompt:
            return None, "media"
        return _single_prompt(prompt.get("prompt_string"))
    return None, "prompt"


def adapter_identity(body: dict[str, Any], adapters: Sequence[tuple[int, str]]) -> tuple[bytes, str | None]:
    """The LoRA identity of a request to a llama-server with `adapters` (id, path) loaded: every adapter with the
    scale the request gives it (0 when it names it not, as llama-server's `construct_lora_list` does), or why the
    request bypasses the cache. Without adapters `lora` changes nothing and the identity is empty."""
    if not adapters:
        return b"", None
    lora = body.get("lora")
    if not lora:
        return b"", "global-lora"
    if not isinstance(lora, list) or not all(isinstance(e, dict) for e in lora):
        return b"", "lora"  # malformed: llama-server's own error reaches the client
    scales: dict[int, float] = {}
    for entry in lora:
        ident, scale = entry.get("id", -1), entry.get("scale", 0.0)
        if not _is_int(ident) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
            return b"", "lora"
        scales[ident] = float(scale)
    h = hashlib.blake2b(b"kvstash/lora/v1", digest_size=16)
    for ident, path in adapters:
        name = path.encode()
        # llama-server holds scales as float: two requests with the same float32 scale share KV
        h.update(struct.pack("<iI", ident, len(name)) + name + struct.pack("<f", scales.get(ident, 0.0)))
    return b"lora:" + h.digest(), None


def plan(body: dict[str, Any], route: str, adapters: Sequence[tuple[int, str]] = ()) -> Plan:
    """How to serve `body` sent to `route` (one of CHAT_ROUTES or TEXT_ROUTES)."""
    chat = route in CHAT_ROUTES
    stream = body.get("stream") is True
    n = body.get("n_cmpl", body.get("n", 1))
    slots = n if _is_int(n) and n > 1 else 1
    identity, why = adapter_identity(body, adapters)
    if chat:
        if _media_in_messages(body.get("messages")):
            why = "media"
        return Plan(True, None, identity, slots, stream, why)
    prompt, problem = _single_prompt(body.get("prompt"))
    return Plan(False, prompt, identity, slots, stream, problem or why)


def salt(tenant_salt: bytes, identity: bytes) -> bytes:
    """The salt a request's blocks are chained under: the tenant's, with the identity folded in (length-prefixed, so
    no tenant salt and identity can be confused with another pair)."""
    if not identity:
        return tenant_salt
    return struct.pack("<I", len(tenant_salt)) + tenant_salt + identity


def event_json(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one server-sent event (`data: {...}`), None for anything else ([DONE], pings, errors)."""
    for line in event.splitlines():
        if line.startswith(b"data: ") and line[6:7] == b"{":
            try:
                out = json.loads(line[6:])
            except ValueError:
                return None
            return out if isinstance(out, dict) else None
    return None


def timings_of(reply: Any) -> dict[str, Any] | None:
    """llama-server's timings of the first choice of a reply (an object, or a list of them from /completion with
    n > 1), None if it carries none."""
    if isinstance(reply, list):
        first = [r for r in reply if isinstance(r, dict) and r.get("index", 0) == 0]
        reply = first[0] if first else None
    if not isinstance(reply, dict):
        return None
    choices = reply.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict) and choices[0].get("index", 0) != 0:
        return None  # the timings of another choice (n > 1, streamed)
    timings = reply.get("timings")
    return timings if isinstance(timings, dict) else None


def is_final(event: dict[str, Any]) -> bool:
    """A streamed event that ends a choice (or carries the usage): from here on the sidecar holds events back
    until the request's KV is written."""
    if event.get("stop") is True or "usage" in event:
        return True
    choices = event.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
