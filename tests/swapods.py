"""Test helpers (no tests) for sliding-window and hybrid models through two in-process pods, shared by the hf and
the llama.cpp engine's suites: the conversation, its turns, what a test does to the boundary records between, and
`RecordChecks`, the checks both engines' records pass (each suite subclasses it once)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from starlette.testclient import TestClient

from cachestore.boundary import BoundaryRecord, pack_boundary, unpack_boundary
from ops.redisproc import RedisProcess
from service.engines import GenParams
from service.engines.generation import GenRequest
from tests.faultkit import reply_of
from tests.support import cached_tokens, chat, ok, pod_pair, rewrite_values, wait_written

BLOCK = 16
MAX_TOKENS = 12
# longer than 4 x the window from the first turn on
SYSTEM = {"role": "system", "content": "You are a patient tutor of natural science. " + " ".join(
    f"Rule {i}: answer briefly, name one example, and say what is measured and how it is measured." for i in range(9))}
QUESTIONS = ["What is photosynthesis?", "Where in the cell does it happen?", "What gas does it release?",
             "Why does that matter for animals?", "How do plants take in water?", "What is transpiration?"]
KEYS = {"key-x": "tenant-x", "key-y": "tenant-y"}


@contextmanager
def pods(redis_url: str, engines: dict[str, Any], kind: dict[str, str],
         **overrides: Any) -> Iterator[tuple[TestClient, TestClient]]:
    """Pods `a` and `b` on engines a and b; `kind` names the engine and the model (`engine`, `model`). No local tier,
    and every hit fetched, so what a test does to Redis is what the next turn reads."""
    settings = {"codec": "exact", "block_tokens": BLOCK, "local_tier_bytes": 0, "fetch_policy": "always", **kind}
    with pod_pair(redis_url, engines, **settings, **overrides) as pair:
        yield pair


def ask(pod: TestClient, engine: Any, messages: list[dict[str, str]], headers: dict[str, str] | None = None) -> Any:
    """A greedy chat of MAX_TOKENS with its token ids, checked to succeed."""
    return ok(chat(pod, messages, model=engine.name, max_tokens=MAX_TOKENS, return_token_ids=True, headers=headers))


def second_turn(engines: dict[str, Any], server: RedisProcess, mutate: Any, kind: dict[str, str],
                headers: tuple[dict[str, str], dict[str, str]] = ({}, {}), **overrides: Any) -> Any:
    """Turn 1 on pod a, `mutate(server)`, turn 2 on pod b: its response, checked to reply as a prefill would."""
    messages = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
    with pods(server.url, engines, kind, **overrides) as (a, b):
        first = ask(a, engines["a"], messages, headers=headers[0])
        wait_written(a)
        mutate(server)
        messages += [{"role": "assistant", "content": reply_of(first)}, {"role": "user", "content": QUESTIONS[1]}]
        second = ask(b, engines["b"], messages, headers=headers[1])
    prefilled = engines["reference"].generate(GenRequest(second.json()["prompt_token_ids"], None,
                                                         GenParams(max_tokens=MAX_TOKENS)))
    assert reply_of(second) == prefilled.text
    return second


def drop_records(server: RedisProcess) -> None:
    """Delete every boundary record, checking the blocks are there (alone they are no hit)."""
    client = redis.Redis.from_url(server.url)
    try:
        client.delete(*client.scan_iter(match="kvstash:bnd:*"))
        assert list(client.scan_iter(match="kvstash:blk:*"))
    finally:
        client.close()


def flip_state_byte(value: bytes) -> bytes:
    """A boundary record with one byte of its state flipped."""
    return value[:-5] + bytes([value[-5] ^ 0x40]) + value[-4:]


def rewriting(change: Any) -> Any:
    """A `mutate` for `second_turn`: every boundary record replaced by `change(record)`, TTL kept."""
    return lambda server: rewrite_values(server.url, "bnd", change)


def with_state(state: bytes, not_at: int | None = None) -> Any:
    """A `change` for `rewriting`: the record, checksum and all, with `state` for its own (checking it is not at
    position `not_at`)."""

    def change(value: bytes) -> bytes:
        record = unpack_boundary(value)
        assert record.position != not_at
        return pack_boundary(BoundaryRecord(record.position, record.token_ids, record.frame, state))

    return change


def foreign_states_miss(engines: dict[str, Any], server: RedisProcess, kind: dict[str, str], foreign: bytes) -> None:
    """Records whose state is `foreign` (another model's), and records whose state is this model's at a position no
    record is at (one token before the prompt's end): the second turn misses either way."""
    assert cached_tokens(second_turn(engines, server, rewriting(with_state(foreign)), kind)) == 0
    reference = engines["reference"]
    prompt = reference.chat_ids([SYSTEM, {"role": "user", "content": QUESTIONS[0]}])
    position, state = reference.generate(GenRequest(prompt[:-1], None, GenParams(max_tokens=1))).boundaries[-1]
    assert position == len(prompt) - 1
    client = redis.Redis.from_url(server.url)
    client.flushdb()
    client.close()
    assert cached_tokens(second_turn(engines, server, rewriting(with_state(state, not_at=position)), kind)) == 0


class RecordChecks:
    """What every engine's boundary records do between two pods: the second turn hits on the other pod past 4 windows;
    a record that is missing, corrupt, of another layout or position, or of another tenant is a miss, and the reply is
    a prefill's either way. A suite subclasses it as `Test...`, with a module fixture `engines` (pods a and b's
    engines and the reference's) and the members below that raise."""

    window: int  # the tiny models' window

    def kind(self, engines: dict[str, Any]) -> dict[str, str]:
        """The pods' `engine` and `model` settings."""
        raise NotImplementedError

    def load(self, name: str) -> Any:
        """The suite's engine of tiny model `name` (the caller closes it)."""
        raise NotImplementedError

    def other(self, engines: dict[str, Any]) -> str:
        """A tiny model of another layout than the engines' (a sliding one's: a recurrent one, and back)."""
        raise NotImplementedError

    def foreign(self, engines: dict[str, Any]) -> bytes:
        """A well-formed boundary state of another layout: the other model's, at its prompt's end."""
        engine = self.load(self.other(engines))
        try:
            prompt = engine.chat_ids([SYSTEM, {"role": "user", "content": QUESTIONS[0]}])
            return engine.generate(GenRequest(prompt, None, GenParams(max_tokens=4))).boundaries[-1][1]
        finally:
            engine.close()

    def test_the_second_turn_hits_on_the_other_pod(self, engines: dict[str, Any], redis_server: RedisProcess) -> None:
        second = second_turn(engines, redis_server, lambda _: None, self.kind(engines))
        assert cached_tokens(second) > 4 * self.window

    def test_a_missing_record_is_a_miss(self, engines: dict[str, Any], redis_server: RedisProcess) -> None:
        assert cached_tokens(second_turn(engines, redis_server, drop_records, self.kind(engines))) == 0

    def test_a_corrupt_record_is_a_miss(self, engines: dict[str, Any], redis_server: RedisProcess) -> None:
        second = second_turn(engines, redis_server, rewriting(flip_state_byte), self.kind(engines))
        assert cached_tokens(second) == 0

    def test_a_record_of_another_layout_or_position_is_a_miss(self, engines: dict[str, Any],
                                                              redis_server: RedisProcess) -> None:
        """A well-formed record, checksum and all, whose state is another model's, or this model's at another
        position."""
        foreign_states_miss(engines, redis_server, self.kind(engines), self.foreign(engines))

    def test_another_tenants_records_are_a_miss(self, engines: dict[str, Any], redis_server: RedisProcess) -> None:
        second = second_turn(engines, redis_server, lambda _: None, self.kind(engines), api_keys=KEYS,
                             headers=({"authorization": "Bearer key-x"}, {"authorization": "Bearer key-y"}))
        assert cached_tokens(second) == 0 and second.headers["x-kv-cache"] == "miss"
