"""The workload of `kvstash bench fleet`: N users in multi-round chats, turns arriving as a Poisson process
(of a fixed count: `arrivals`).

Each user has a system prompt (one shared by every user, or one of its own), a history of earlier exchanges, and
then asks a short question per turn; its client is stateless (the OpenAI way: the whole conversation is resent
every turn, no session id unless the fleet is sticky) and streams the reply. Arrivals are drawn for the whole
fleet at `rate` per second and dealt to the users in turn; a user whose previous reply has not come yet holds its
next turn until it has (a chat client cannot send turn k+1 before reading reply k), and that wait counts in the
turn's TTFT, which is measured from the arrival. Every loop is bounded: the arrivals by the duration and a count,
each request by a timeout, the whole run by a drain deadline after the last arrival.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ops.bench.common import SAMPLE_TEXT, percentile

CHARS_PER_TOKEN = 4.4  # English prose under SmolLM2's tokenizer (ops/bench/fleet/load.py measured it)
MAX_ARRIVALS = 2000  # whatever the rate and duration, a run sends at most this many turns
REQUEST_TIMEOUT_S = 300.0
STICKY_HEADER = "X-Session-Id"


@dataclass(frozen=True)
class Workload:
    users: int
    system_tokens: int = 300
    history_tokens: int = 1200
    query_tokens: int = 30
    max_tokens: int = 32
    shared_system: bool = True
    reuse: bool = True  # False: every turn is a new user's first (the miss-overhead workload)
    max_turns: int = 24  # a user starts a new conversation after this many turns (bounds the context)


def _words() -> list[str]:
    return SAMPLE_TEXT.read_text(encoding="utf-8").split()


def _prose(seed: int, tokens: int) -> str:
    """About `tokens` tokens of prose from ops/data/sample.txt, starting at a place picked by `seed`."""
    words = _words()
    count = max(1, int(tokens * CHARS_PER_TOKEN / 5.6))  # ~5.6 characters a word, space included
    start = (seed * 7919) % len(words)
    return " ".join((words * (2 + count // len(words)))[start:start + count])


def opening(workload: Workload, tag: str, user: int) -> list[dict[str, str]]:
    """A user's system prompt and history: the conversation its first turn resends."""
    head = "You are a concise assistant for the notes below." if workload.shared_system else f"User {tag}-{user}."
    system = head + "\n\n" + _prose(0 if workload.shared_system else user + 1, workload.system_tokens)
    messages = [{"role": "system", "content": system}]
    exchanges = max(1, workload.history_tokens // 150)
    for i in range(exchanges):
        messages += [{"role": "user", "content": f"[{tag}-{user}] Part {i}: " + _prose(user * 31 + i, 120)},
                     {"role": "assistant", "content": f"Noted part {i}, user {user}."}]
    return messages


def question(seed: int, tokens: int) -> str:
    return "Question: " + _prose(seed + 101, tokens) + "?"


def arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of `rate` x `duration_s` turns (at most MAX_ARRIVALS), each uniform over the
    run: a Poisson process at `rate` given its count. Its bursts stay; only the count is fixed, so a run's load is
    the rate it is labelled with (a free Poisson count per seed drifts far from it over a minute)."""
    rng = random.Random(seed)
    count = min(MAX_ARRIVALS, round(rate * duration_s))
    return sorted(rng.uniform(0.0, duration_s) for _ in range(count))


class ChatUser:
    """One stateless chat client: its conversation so far, and the lock that keeps its turns in order."""

    def __init__(self, workload: Workload, tag: str, index: int) -> None:
        self.workload, self.tag, self.index = workload, tag, index
        self.conversation = 0
        self.messages = opening(workload, f"{tag}.{self.conversation}", index)
        # user i of n starts i/n of the way through its first conversation, with that many earlier exchanges: every
        # rate, the lowest (the knee's baseline) too, sees histories of every length, as a fleet in service does,
        # and the users' conversations end one after another, not all at once
        self.turns = index * workload.max_turns // max(1, workload.users) if workload.reuse else 0
        reply_tokens = max(1, workload.max_tokens // 2)  # replies often end before their limit
        for k in range(self.turns):
            self.messages += [{"role": "user", "content": question(-1000 * (index + 1) - k, workload.query_tokens)},
                              {"role": "assistant", "content": _prose(index * 53 + k, reply_tokens)}]
        self.lock = threading.Lock()

    def restart(self) -> None:
        self.conversation += 1
        self.turns = 0
        self.messages = opening(self.workload, f"{self.tag}.{self.conversation}", self.index)


def session_id(user: ChatUser) -> str:
    """The id a sticky fleet's balancer hashes for the user's conversation: random-looking, as a client's session ids
    are. (Ids that differ in one character, `sticky-0-0`, `sticky-1-0`, land together on nginx's crc32 ring: four
    of them all on one of two pods about a quarter of the time, against an eighth for independent ones.)"""
    return hashlib.sha256(f"{user.tag}-{user.index}-{user.conversation}".encode()).hexdigest()[:16]


def send_turn(user: ChatUser, model: str, url: str, arrived_at: float, started: float, deadline: float,
          sticky: bool, seq: int) -> dict[str, Any]:
    import httpx  # noqa: PLC0415

    from ops.chatclient import StreamLost, stream_chat  # noqa: PLC0415

    wl = user.workload
    with user.lock:  # the user's previous turn must have been answered
        if time.monotonic() > deadline:
            return {"user": user.index, "arrived_s": arrived_at, "status": -1, "error": "not sent: run ended"}
        if not wl.reuse or user.turns >= wl.max_turns:
            user.restart()
        user.messages.append({"role": "user", "content": question(seq, wl.query_tokens)})
        body = {"model": model, "messages": user.messages, "max_tokens": wl.max_tokens, "temperature": 0}
        headers = {STICKY_HEADER: session_id(user)} if sticky else {}
        row: dict[str, Any] = {"user": user.index, "turn": user.turns + 1, "arrived_s": arrived_at,
                               "session": f"{user.tag}-{user.index}.{user.conversation}"}
        sent = time.monotonic()
        row["sent_s"] = sent - started
        try:
            with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
                res = stream_chat(client, url, body, headers=headers)
        except Exception as exc:  # noqa: BLE001 - a failed request is a row, counted
            user.messages.pop()
            held = {"pod": exc.pod, "upstream": exc.upstream} if isinstance(exc, StreamLost) else {}
            return {**row, **held, "status": 0, "error": f"{type(exc).__name__}: {exc}"[:200],
                    "ended_s": time.monotonic() - started}
        queued_ms = (sent - started - arrived_at) * 1000
        row.update(status=res.status, pod=res.pod, upstream=res.upstream, cache=res.cache,
                   prompt_tokens=res.prompt_tokens, cached_tokens=res.cached_tokens,
                   completion_tokens=res.completion_tokens,
                   queued_ms=queued_ms, ttft_ms=queued_ms + res.ttft_ms, service_ttft_ms=res.ttft_ms,
                   total_ms=queued_ms + res.total_ms, decode_ms=res.total_ms - res.ttft_ms,
                   itl_ms=(res.total_ms - res.ttft_ms) / max(1, res.completion_tokens - 1),
                   ended_s=time.monotonic() - started)
        if res.status != 200:
            user.messages.pop()
            row["error"] = res.text[:200]
            return row
        user.messages.append({"role": "assistant", "content": res.text})
        user.turns += 1
        return row


def make_users(workload: Workload, tag: str) -> list[ChatUser]:
    return [ChatUser(workload, tag, i) for i in range(workload.users)]


def warm_up(users: Sequence[ChatUser], model: str, url: str, sticky: bool) -> list[dict[str, Any]]:
    """Each user's first turn, all at once and not measured: the runs that follow see conversations under way, as a
    fleet in service does, instead of every user's opening at once."""
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, len(users))) as pool:
        return list(pool.map(lambda u: send_turn(u, model, url, 0.0, start, start + REQUEST_TIMEOUT_S, sticky,
                                                 -1 - u.index), users))


def deal(count: int, users: int, skew: float, seed: int) -> list[int]:
    """Which user sends each of `count` turns: in turn (skew 0), or drawn with user i's weight 1 / (i + 1) ** skew
    (Zipf: at skew 1 the first user sends twice the second's turns and n times the n-th's)."""
    if skew <= 0:
        return [seq % users for seq in range(count)]
    rng = random.Random(seed * 7 + 3)  # apart from the arrival times' stream
    return rng.choices(range(users), weights=[1 / (i + 1) ** skew for i in range(users)], k=count)


def drive(workload: Workload, url: str, model: str, rate: float, duration_s: float, *, tag: str, seed: int,
          sticky: bool, drain_s: float, users: list[ChatUser] | None = None, skew: float = 0.0,
          started: float | None = None,
          on_row: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send the run's turns at their arrival times; wait at most `drain_s` after the last arrival for replies.
    `users`: conversations to go on with (default: new ones, tagged `tag`); `skew`: their activity (`deal`);
    `started`: the run's clock (default: now); `on_row`: called with each turn's row as it ends."""
    users = users if users is not None else make_users(workload, tag)
    times = arrivals(rate, duration_s, seed)
    senders = deal(len(times), len(users), skew, seed)
    started = time.monotonic() if started is None else started
    deadline = started + duration_s + drain_s

    def turn(seq: int, at: float) -> dict[str, Any]:
        row = send_turn(users[senders[seq]], model, url, at, started, deadline, sticky, seq)
        if on_row is not None:
            on_row(row)
        return row

    pool = ThreadPoolExecutor(max_workers=min(64, max(1, len(times))))
    futures = []
    for seq, at in enumerate(times):
        delay = started + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(turn, seq, at))
    rows = []
    for f in futures:
        remaining = max(0.1, deadline + REQUEST_TIMEOUT_S - time.monotonic())
        rows.append(f.result(timeout=remaining))
    pool.shutdown(wait=True)
    return rows, time.monotonic() - started


def stats(rows: Sequence[dict[str, Any]], rate: float, duration_s: float) -> dict[str, Any]:
    """TTFT p50/p90/p99, inter-token latency, tokens/s, hit rate and failures of one run at one rate."""
    ok = [r for r in rows if r.get("status") == 200]
    unsent = [r for r in rows if r.get("status") == -1]
    failed = [r for r in rows if r.get("status") not in (200, -1)]
    ttft = [r["ttft_ms"] for r in ok]
    itl = [r["itl_ms"] for r in ok]
    end = max([r["ended_s"] for r in ok], default=duration_s)
    prompt = sum(r["prompt_tokens"] for r in ok)
    # keeping pace: everything that arrived was answered, and the last reply came soon after the last arrival
    last_arrival = max([r["arrived_s"] for r in rows], default=0.0)
    lag_s = max(0.0, end - last_arrival)
    return {
        "rate": rate, "arrivals": len(rows), "ok": len(ok), "failed": len(failed), "unsent": len(unsent),
        "achieved_rate": len(ok) / max(end, duration_s) if ok else 0.0,
        "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p90": percentile(ttft, 0.9),
        "ttft_ms_p99": percentile(ttft, 0.99),
        "queued_ms_p90": percentile([r["queued_ms"] for r in ok], 0.9),
        "itl_ms_p50": percentile(itl, 0.5), "itl_ms_p90": percentile(itl, 0.9),
        "completion_tokens_per_s": sum(r["completion_tokens"] for r in ok) / max(end, duration_s) if ok else 0.0,
        "prompt_tokens_per_s": prompt / max(end, duration_s) if ok else 0.0,
        "hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "drain_lag_s": lag_s, "wall_s": end,
        "errors": sorted({r.get("error", "")[:120] for r in failed})[:5],
    }
