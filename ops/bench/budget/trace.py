"""Conversation traces for `kvstash bench budget`: read from JSON lines or generated, cut into chained blocks, and
the hit rates of an infinite cache and of the offline optimum (Belady) on them.

A trace is a list of requests `(session, tokens)`: that session's prompt is now `tokens` long and extends its last
one; a session may start with a shared system prompt (`prefix`, `prefix_tokens` tokens), whose blocks every session
that names it shares. Hits are counted as pods count them: the longest prefix of a prompt's blocks that is present.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachestore.errors import KvstashError
from cachestore.hashing import BlockHash

TRACE_FIELDS = {"session", "tokens", "prefix", "prefix_tokens"}


class TraceError(KvstashError):
    """A trace file that cannot be replayed (its line number is in the message)."""


@dataclass
class Trace:
    requests: list[tuple[str, int]] = field(default_factory=list)
    prefix_of: dict[str, str] = field(default_factory=dict)  # session -> its shared system prompt
    prefix_tokens: dict[str, int] = field(default_factory=dict)  # system prompt -> its length in tokens
    sessions: set[str] = field(default_factory=set)

    def add(self, session: str, tokens: int, prefix: str | None = None, prefix_tokens: int | None = None,
            where: str = "") -> None:
        if prefix is not None:
            known = self.prefix_tokens.get(prefix)
            if prefix_tokens is None and known is None:
                raise TraceError(f"{where}prefix {prefix!r} is new: give its prefix_tokens")
            if prefix_tokens is not None and known is not None and prefix_tokens != known:
                raise TraceError(f"{where}prefix {prefix!r} was {known} tokens, now {prefix_tokens}")
            if self.prefix_of.get(session, prefix) != prefix:
                raise TraceError(f"{where}session {session!r} started with prefix {self.prefix_of[session]!r}")
            if session not in self.prefix_of and session in self.sessions:
                raise TraceError(f"{where}session {session!r} started without a prefix")
            self.prefix_tokens[prefix] = prefix_tokens if prefix_tokens is not None else known or 0
            self.prefix_of[session] = prefix
        elif prefix_tokens is not None:
            raise TraceError(f"{where}prefix_tokens without a prefix")
        self.requests.append((session, tokens))
        self.sessions.add(session)


def read_trace(path: str | Path) -> Trace:
    """A trace from JSON lines `{"session": "<id>", "tokens": N}` (optional `"prefix"`, `"prefix_tokens"`); blank
    lines are skipped. Raises TraceError naming the line of a malformed line, an unknown field, a negative count."""
    trace = Trace()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        where = f"{path}:{number}: "
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}not JSON ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise TraceError(f"{where}a line is a JSON object")
        unknown = sorted(set(entry) - TRACE_FIELDS)
        if unknown:
            raise TraceError(f"{where}unknown field {unknown[0]!r} (fields: {', '.join(sorted(TRACE_FIELDS))})")
        session, prefix = entry.get("session"), entry.get("prefix")
        if not isinstance(session, str) or not session:
            raise TraceError(f"{where}session must be a non-empty string")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise TraceError(f"{where}prefix must be a non-empty string")
        for name in ("tokens", "prefix_tokens"):
            value = entry.get(name)
            if (name == "tokens" or value is not None) and (not isinstance(value, int) or isinstance(value, bool)
                                                             or value < 0):
                raise TraceError(f"{where}{name} must be a non-negative integer, got {json.dumps(value)}")
        trace.add(session, entry["tokens"], prefix, entry.get("prefix_tokens"), where)
    if not trace.requests:
        raise TraceError(f"{path}: no requests")
    return trace


@dataclass(frozen=True)
class Workload:
    users: int = 80
    turns: int = 8  # mean turns per user
    system_prompts: int = 4
    system_tokens: int = 256
    turn_tokens: int = 64  # mean tokens a turn adds (the user's message and the reply before it)
    history_tokens: int = 64  # mean tokens of history a session starts with besides the system prompt
    max_tokens: int = 8192  # a session that would grow past it starts over as a new session
    skew: float = 0.0  # Zipf exponent of the users' activity (0: uniform): a user's share of the turns
    arrival: str = "interleaved"  # or "sequential": each user's turns one after another
    think: float = 16.0  # interleaved: mean time between a user's turns, in user starts (users start 1 a unit)
    seed: int = 0


def generate(w: Workload) -> Trace:
    """A seeded trace of about `users * turns` requests. Interleaved: users start one a time unit (at random over
    `users` units), each sends its turns `think` units apart on average (exponential), all merged by time, so a
    conversation in progress is likely to come back soon and a finished one never does."""
    rng = random.Random(w.seed)
    weights = [1.0 / (rank + 1) ** w.skew for rank in range(w.users)]
    rng.shuffle(weights)
    total = w.users * w.turns
    counts = [max(1, round(total * x / sum(weights) * rng.uniform(0.5, 1.5))) for x in weights]
    events: list[tuple[float, int]] = []
    for user, n in enumerate(counts):
        at = rng.uniform(0, w.users) if w.arrival == "interleaved" else float(user)
        for _ in range(n):
            events.append((at, user))
            at += rng.expovariate(1 / w.think) if w.arrival == "interleaved" else 1e-6
    events.sort()
    trace, length, restarts = Trace(), [0] * w.users, [0] * w.users
    for _, user in events:
        session = f"u{user}.{restarts[user]}"
        grow = max(1, round(w.turn_tokens * rng.uniform(0.5, 1.5)))
        if length[user] and length[user] + grow > w.max_tokens:
            restarts[user] += 1
            length[user], session = 0, f"u{user}.{restarts[user]}"
        prefix = f"sys{user % w.system_prompts}" if w.system_prompts else None
        if not length[user]:
            length[user] = (w.system_tokens if prefix else 0) + round(rng.uniform(0, 2 * w.history_tokens))
        length[user] += grow
        trace.add(session, length[user], prefix, w.system_tokens if prefix else None)
    return trace


@dataclass
class Blocks:
    """A trace cut into blocks: per request its blocks' ids in chain order; per id its hash and depth."""

    requests: list[list[int]]
    hashes: list[BlockHash]
    depth: list[int]


def cut(trace: Trace, block_tokens: int) -> Blocks:
    """Each request's full blocks. A block inside a session's system prompt is that prompt's (shared); the others
    are the session's. Hashes are chained and deterministic (blake2b of the parent's hash and the block's name)."""
    ids: dict[tuple[str, str, int], int] = {}
    out = Blocks([], [], [])
    for session, tokens in trace.requests:
        prefix = trace.prefix_of.get(session)
        shared = trace.prefix_tokens[prefix] // block_tokens if prefix is not None else 0
        chain: list[int] = []
        parent = b"root"
        for i in range(tokens // block_tokens):
            name = ("p", prefix, i) if i < shared and prefix is not None else ("s", session, i)
            block = ids.get(name)
            if block is None:
                block = ids[name] = len(out.hashes)
                out.hashes.append(BlockHash(hashlib.blake2b(parent + repr(name).encode(), digest_size=16).digest()))
                out.depth.append(i)
            parent = out.hashes[block]
            chain.append(block)
        out.requests.append(chain)
    return out


def longest_present(chain: list[int], held: Any) -> int:
    n = 0
    while n < len(chain) and chain[n] in held:
        n += 1
    return n


def possible_hits(blocks: Blocks) -> list[int]:
    """Per request, the blocks an infinite cache serves: the longest prefix written by an earlier request."""
    seen: set[int] = set()
    out = []
    for chain in blocks.requests:
        out.append(longest_present(chain, seen))
        seen.update(chain)
    return out


def belady_hits(blocks: Blocks, capacity_blocks: int) -> list[int]:
    """Per request, the blocks served by Belady's policy holding at most `capacity_blocks` (all blocks one size):
    after each request, evict the block next needed furthest in the future (never again: furthest of all); on a
    tie, the deepest in its chain."""
    never = len(blocks.requests)
    next_use: list[list[int]] = [[] for _ in blocks.requests]
    upcoming: dict[int, int] = {}
    for r in range(len(blocks.requests) - 1, -1, -1):
        chain = blocks.requests[r]
        next_use[r] = [upcoming.get(b, never) for b in chain]
        for b in chain:
            upcoming[b] = r
    held: set[int] = set()
    due: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    out = []
    for r, chain in enumerate(blocks.requests):
        out.append(longest_present(chain, held))
        for b, when in zip(chain, next_use[r], strict=True):
            held.add(b)
            due[b] = when
            heapq.heappush(heap, (-when, -blocks.depth[b], b))
        while len(held) > capacity_blocks:
            when, _, b = heapq.heappop(heap)
            if b in held and due[b] == -when:  # else a stale heap entry
                held.discard(b)
    return out
