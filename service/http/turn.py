"""A turn: what a completion route hands the request story (service.http.respond), as one value.

The route parses and validates; the turn says what to generate (the prompt, the parameters, how to reply) and to
which session it belongs. The session part says how the reply is recorded: a client that keeps the conversation
itself (a chat completion with a session id) gets its record updated best effort; a server-side session
(/v1/sessions/{id}/messages) must record the reply, with the ids generated for it, or the turn fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from cachestore.sessions import SessionRecord
from service.cache.writeback import SessionWrite
from service.engines import Generation, GenParams
from service.http.params import ToolSpec
from service.http.tenancy import Tenant


class Recorder(Protocol):
    """What writing a session's record needs of the pod (its `Pipeline`): the record, and the engine's text of ids."""

    def record(self, tenant: str, session_id: str, messages: list[dict[str, Any]], gen: Generation,
               previous: SessionRecord | None) -> SessionRecord: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SessionTurn:
    """The session a turn belongs to, and what of it the write-back records."""

    session_id: str
    history: list[dict[str, Any]] | None  # the messages before the reply, as the record keeps them; None: no record
    record: SessionRecord | None = None  # as the route read it (server-side); None: read along with the lookup
    server_side: bool = False  # the reply must be recorded, with its generated ids

    def lookup_key(self, tenant: str) -> tuple[str, str] | None:
        """The record to read along with the lookup: none when the route read it already."""
        return (tenant, self.session_id) if self.record is None else None

    def write(self, pod: Recorder, tenant: str, gen: Generation, reply: dict[str, Any] | None,
              previous: SessionRecord | None) -> SessionWrite | None:
        """The record after `gen`, whose reply message is `reply` (its tool calls included, as the client got
        them); None when nothing is recorded (a text completion, or no history)."""
        if self.history is None or (reply is None and not self.server_side):
            return None
        message: dict[str, Any] = dict(reply or {"role": "assistant", "content": gen.text})
        if (self.server_side and not message.get("tool_calls") and gen.reply_ids
                and pod.decode(gen.reply_ids) == gen.text):
            message["token_ids"] = gen.reply_ids  # the session's next turns never re-tokenize this reply
        record = pod.record(tenant, self.session_id, [*self.history, message], gen, previous)
        return SessionWrite(record, previous.version if previous else None, strict=self.server_side)


@dataclass(frozen=True)
class Turn:
    """One completion to run: admission, lookup, generation, reply and write-back (service.http.respond)."""

    chat: bool
    model: str
    tenant: Tenant
    prompt_ids: list[int]
    params: GenParams
    stream: bool
    include_usage: bool
    session: SessionTurn | None = None
    token_ids: bool = False  # vLLM's `return_token_ids`: the prompt's and the reply's ids in the body
    tools: ToolSpec | None = None
