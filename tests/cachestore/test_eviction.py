"""Chain-aware eviction: chains leave from their end, shared prefixes outlive their chains, concurrent writers keep
the accounting exact; `bench budget` refuses a bad trace by line and writes its rows."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
import torch

from cachestore import budget, repair
from cachestore.codec import Codec
from cachestore.errors import StoreError
from cachestore.hashing import BlockHash
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.cli import main
from ops.redisproc import RedisProcess

MODEL = "0123456789abcdef"
SIZE = 1000


def chain(name: str, n: int, parent: BlockHash | None = None) -> list[BlockHash]:
    out: list[BlockHash] = []
    prev = parent or b"root"
    for i in range(n):
        prev = BlockHash(hashlib.blake2b(prev + f"{name}{i}".encode(), digest_size=16).digest())
        out.append(prev)
    return out


class Clock:
    """A store's clock that a test moves: a second a request, as a replayed trace's."""

    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        self.ms += 1000
        return self.ms


def chain_store(url: str, ns: str, budget: int = 8_000, size: int = SIZE, **extra: int) -> BlockStore:
    return BlockStore(StoreSettings.from_url(url, namespace=ns, budget_bytes=budget, max_value_bytes=size,
                                             index_shards=4, low_watermark=0.6, eviction_policy="chain", **extra),
                      clock_ms=Clock())


def frame() -> bytes:
    return Codec("int8").encode(torch.randn(2, 2, 2, 16, 8, generator=torch.Generator().manual_seed(0)))


async def held_bytes(store: BlockStore) -> int:
    """Bytes the namespace's blocks hold in Redis (SCAN + STRLEN)."""
    sizes = [await store.client.strlen(k) async for k in store.client.scan_iter(match=f"{store.keys.namespace}:blk:*")]
    return sum(sizes)


async def present(store: BlockStore, hashes: list[BlockHash]) -> list[bool]:
    pipe = store.client.pipeline(transaction=False)
    for h in hashes:
        pipe.exists(store.keys.block(MODEL, h)[1])
    return [bool(x) for x in await pipe.execute()]


async def test_a_chain_is_evicted_from_its_end(redis_server: RedisProcess) -> None:
    store = chain_store(redis_server.url, "end")
    try:
        old = chain("old", 6)
        await store.store_blocks(MODEL, old[:3], [bytes(SIZE)] * 3)  # two turns: the second extends the first
        await store.store_blocks(MODEL, old[3:], [bytes(SIZE)] * 3, None, 3, old[2])
        new = chain("new", 3)
        await store.store_blocks(MODEL, new, [bytes(SIZE)] * 3)  # 9,000 > 7,600: evict to 4,800 - 3,000
        kept = await present(store, old)
        assert store.stats().evictions > 0 and kept != [True] * 6
        assert kept == sorted(kept, reverse=True)  # a prefix: the end went, the head stayed
        assert all(await present(store, new)) and (await store.dead()).bytes == 0
    finally:
        await store.clear_namespace()
        await store.close()


async def test_a_shared_prefix_outlives_the_chains_that_use_it(redis_server: RedisProcess) -> None:
    store = chain_store(redis_server.url, "shared", budget=12_000)
    try:
        system = chain("sys", 2)
        await store.store_blocks(MODEL, system, [bytes(SIZE)] * 2)
        users: list[list[BlockHash]] = [[] for _ in range(3)]
        for turn in range(4):  # each user's turn reads the system prompt and its own blocks, then writes on
            for u, own in enumerate(users):
                got = await store.count_present(MODEL, system + own)
                assert got.value >= 2  # the system prompt is always there
                users[u] = own = own + chain(f"user{u}-turn{turn}", 1, (system + own)[-1])
                whole, held = system + own, got.value  # as a pod: the blocks after the present prefix written
                await store.store_blocks(MODEL, whole[held:], [bytes(SIZE)] * (len(whole) - held), None, held,
                                         whole[held - 1])
        assert store.stats().evictions > 0
        assert all(await present(store, system))
        assert not all(await present(store, [b for own in users for b in own]))
        assert (await store.dead()).bytes == 0
    finally:
        await store.clear_namespace()
        await store.close()


@pytest.mark.parametrize("where", ["redis_server", "redis_cluster"])
async def test_two_writers_evicting_at_once_keep_the_accounting(where: str, request: pytest.FixtureRequest) -> None:
    value = frame()  # a real frame: verify decodes every block
    size = len(value)
    url = request.getfixturevalue(where).url + ("?cluster=1" if where == "redis_cluster" else "")
    stores = [chain_store(url, "two", budget=20 * size, size=size) for _ in range(2)]

    async def writer(w: int) -> None:
        for c in range(12):
            blocks = chain(f"w{w}c{c}", 6)
            await stores[w].store_blocks(MODEL, blocks[:3], [value] * 3)
            held = (await stores[w].count_present(MODEL, blocks)).value  # the next turn, as a pod writes it
            await stores[w].store_blocks(MODEL, blocks[held:], [value] * (6 - held), None, held,
                                         blocks[held - 1] if held else None)

    try:
        await asyncio.gather(writer(0), writer(1))
        assert sum(s.stats().evictions for s in stores) > 0
        actual = await held_bytes(stores[0])
        assert (await stores[0].usage()).bytes_held == actual <= 23 * size
        report = await repair.verify(stores[0].client, stores[0].keys)
        # the index is what Redis holds, and no block is left whose parent the other writer evicted
        assert report.index_entries == actual // size and report.problems == {}, report.problems
    finally:
        await stores[0].clear_namespace()
        for s in stores:
            await s.close()


async def test_blocks_written_on_a_parent_being_evicted_go_with_it(redis_server: RedisProcess) -> None:
    value = frame()  # a real frame: verify decodes every block
    store = chain_store(redis_server.url, "orphans", budget=100 * len(value), size=len(value))
    try:
        x = chain("x", 5)
        await store.store_blocks(MODEL, x[:3], [value] * 3)
        shard, parent = store.keys.block(MODEL, x[2])
        index = store.keys.shard(shard)
        seen = await store.client.zscore(index.lru, parent)  # an evictor's PEEK reads the chain's end ...
        await store.store_blocks(MODEL, x[3:], [value] * 2, None, 3, x[2])  # ... a writer adds to it ...
        reply = await store.client.eval(budget.EVICT, len(index.all()) + 1, *index.all(), parent, "", f"{seen:.17g}")
        assert [k.decode() for k in reply[4:]] == [parent]  # ... and its EVICT still takes it
        reaped = await budget.reap(store.client, store.keys, [parent])
        assert reaped.evicted_blocks == 2 and await present(store, x) == [True, True, False, False, False]
        assert (await repair.verify(store.client, store.keys)).problems == {}
        # a parent already gone: nothing is written on it
        assert (await store.store_blocks(MODEL, x[3:], [value] * 2, None, 3, x[2])).value == 0
        assert await present(store, x[3:]) == [False, False] and (await store.dead()).blocks == 0
        assert store.stats().lost_parent_writes == 1
    finally:
        await store.clear_namespace()
        await store.close()


async def test_a_pod_holding_a_lost_prefix_writes_it_again(redis_server: RedisProcess) -> None:
    """Redis flushed under a conversation: the pod whose local tier still holds the chain's frames writes the chain
    again from block 0 and its new blocks on it, so another pod's next turn hits; without the frames, nothing."""
    value = frame()
    store = chain_store(redis_server.url, "lost", budget=100 * len(value), size=len(value), local_tier_bytes=1 << 20)
    other = chain_store(redis_server.url, "lost", budget=100 * len(value), size=len(value))  # no local tier
    try:
        x = chain("x", 5)
        await store.store_blocks(MODEL, x[:3], [value] * 3)
        await store.client.flushdb()  # Redis restarted empty; the pod still holds x[:3]
        # the stale `parent` argument is checked against the prefix's last
        assert (await store.store_blocks(MODEL, x[3:], [value] * 2, None, 3, prefix=x[:3])).value == 2
        assert await present(store, x) == [True] * 5 and store.stats().blocks_restored == 3
        assert (await other.count_present(MODEL, x)).value == 5  # what another pod's lookup finds
        assert (await repair.verify(store.client, store.keys)).problems == {}
        await store.client.flushdb()  # a pod without the frames (no local tier): nothing written on a lost parent
        assert (await other.store_blocks(MODEL, x[3:], [value] * 2, None, 3, prefix=x[:3])).value == 0
        assert await present(store, x) == [False] * 5 and other.stats().lost_parent_writes == 1
        with pytest.raises(StoreError, match="prefix"):
            await store.store_blocks(MODEL, x[3:], [value] * 2, None, 3, x[1], prefix=x[:3])
    finally:
        await store.clear_namespace()
        await store.close()
        await other.close()


@pytest.mark.parametrize(("lines", "error"), [
    (['{"session": "a", "tokens": 64}', '{"session": "a", "tokens": 12'], ":2: not JSON"),
    (['{"session": "a", "tokens": 64}', "", '{"session": "a", "tokens": 64, "turn": 2}'], ":3: unknown field 'turn'"),
    (['{"session": "a", "tokens": -1}'], ":1: tokens must be a non-negative integer"),
])
def test_a_bad_trace_is_refused_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              lines: list[str], error: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["bench", "budget", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{trace}{error}" in err


def test_bench_budget_replays_a_trace_against_the_optimum(redis_server: RedisProcess, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(e) for e in [
        {"session": "a", "tokens": 40, "prefix": "sys", "prefix_tokens": 16},
        {"session": "b", "tokens": 36, "prefix": "sys"}, {"session": "a", "tokens": 64},
        {"session": "b", "tokens": 60}, {"session": "a", "tokens": 80}]))
    out = tmp_path / "budget.json"
    assert main(["bench", "budget", "--redis-url", redis_server.url, "--trace", str(trace), "--block-tokens", "8",
                 "--block-bytes", "100", "--policies", "lru,chain", "--budget-ratios", "1,3",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["policy"], r["budget_ratio"]) for r in rows] == [("lru", 1), ("chain", 1), ("lru", 3), ("chain", 3)]
    assert [r["default"] for r in rows] == [False, True, False, True]
    for r in rows:
        assert 0 <= r["hit_rate"] <= 1 and 0 < r["optimum_hit_rate"] <= 1 and r["dead_bytes"] >= 0
    assert rows[0]["hit_rate"] == rows[0]["optimum_hit_rate"] == 1  # all of it fits: every possible hit
    generated = tmp_path / "gen.json"
    assert main(["bench", "budget", "--redis-url", redis_server.url, "--users", "4", "--turns", "3",
                 "--block-bytes", "100", "--policies", "chain", "--budget-ratios", "2", "--json", str(generated)]) == 0
    assert json.loads(generated.read_text())["rows"][0]["requests"] >= 4
