"""Session records: compare-and-set, fork, list, strict parsing, and two processes writing one session."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from cachestore.keys import InvalidName
from cachestore.sessions import SessionRecord
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.redisproc import RedisProcess
from tests.paths import ROOT
from tests.storekit import namespace_for, scratch_store


@pytest.fixture
async def store(shared_kv_server: RedisProcess, request: pytest.FixtureRequest) -> AsyncIterator[BlockStore]:
    # one namespace per test and server flavor
    async with scratch_store(StoreSettings.from_url(shared_kv_server.url,
                                                    namespace=namespace_for(request, "sess-"))) as s:
        yield s


def record(session_id: str = "s1", tenant: str = "acme") -> SessionRecord:
    return SessionRecord(tenant, session_id, "0123456789abcdef", token_ids=[1, 2, 70000, 2**32 - 1],
                         messages=[{"role": "user", "content": "héllo"}], partial=b"\x00KV\xff")


async def test_create_read_and_compare_and_set(store: BlockStore) -> None:
    assert (await store.read_session("acme", "s1")).value is None
    first = (await store.write_session(record(), expected_version=None)).value
    assert first is not None and first.version == 1 and first.created_at > 0
    assert (await store.write_session(record(), expected_version=None)).value is None  # exists already
    read = (await store.read_session("acme", "s1")).value
    assert read == first
    read.token_ids.append(5)
    second = (await store.write_session(read, expected_version=1)).value
    assert second is not None and second.version == 2 and second.created_at == first.created_at
    assert (await store.write_session(first, expected_version=1)).value is None  # the stale writer learns it lost
    assert store.stats().cas_conflicts == 2
    assert (await store.read_session("acme", "s1")).value.token_ids == [1, 2, 70000, 2**32 - 1, 5]


async def test_fork_list_delete(store: BlockStore) -> None:
    await store.write_session(record("s1"), None)
    await store.write_session(record("s9", tenant="other"), None)
    child = (await store.fork_session("acme", "s1", "s1.fork")).value
    assert child is not None and child.version == 1 and child.token_ids == record().token_ids
    assert (await store.fork_session("acme", "s1", "s1.fork")).value is None  # id taken
    assert (await store.fork_session("acme", "missing", "x")).value is None
    assert await store.list_sessions("acme") == [("acme", "s1"), ("acme", "s1.fork")]
    assert len(await store.list_sessions()) == 3
    assert await store.delete_session("acme", "s1") is True
    assert await store.delete_session("acme", "s1") is False
    assert (await store.read_session("acme", "s1.fork")).value is not None  # the fork lives on


async def test_record_is_plain_and_garbage_is_a_counted_miss(store: BlockStore,
                                                             shared_kv_server: RedisProcess) -> None:
    await store.write_session(record(), None)
    key = store.keys.session("acme", "s1")
    client = shared_kv_server.client()
    raw = client.hgetall(key)
    assert raw[b"messages"].decode() == '[{"role":"user","content":"héllo"}]'
    assert raw[b"n_tokens"] == b"4" and raw[b"version"] == b"1" and raw[b"partial"] == b"\x00KV\xff"
    assert client.pttl(key) > 0
    for field, bad in [(b"token_ids", b"!!!"), (b"n_tokens", b"5"), (b"messages", b"{not json"),
                       (b"messages", b'{"a": 1}'), (b"version", b"x"), (b"tenant", b"evil")]:
        client.hset(key, field, bad)
        assert (await store.read_session("acme", "s1")).value is None
        client.hset(key, mapping=raw)
        assert (await store.read_session("acme", "s1")).value is not None
    client.delete(key)
    client.set(key, b"not a hash")
    assert (await store.read_session("acme", "s1")).value is None
    assert store.stats().bad_records == 6 and store.stats().errors == 1


async def test_bad_ids_raise_clearly(store: BlockStore) -> None:
    for tenant, sid in [("acme", "a b"), ("acme", ""), ("acme", "x" * 129), ("ac:me", "s"), ("acme", "s*")]:
        with pytest.raises(InvalidName):
            await store.read_session(tenant, sid)
    with pytest.raises(InvalidName):
        SessionRecord("acme", "bad id", "m")


WRITER = textwrap.dedent("""
    import sys
    from cachestore.sessions import SessionRecord
    from cachestore.settings import StoreSettings
    from cachestore.syncstore import SyncBlockStore
    import redis
    url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    lost = 0
    with SyncBlockStore(StoreSettings.from_url(url, namespace="twoproc", op_timeout_s=2)) as store:
        gate = redis.Redis.from_url(url)
        gate.rpush("twoproc-ready", name)
        gate.blpop(["twoproc-go-" + name], timeout=30)  # both start at once, so their turns really interleave
        for i in range(n):
            while True:
                rec = store.read_session("acme", "shared").value
                rec.messages.append({"writer": name, "i": i})
                if store.write_session(rec, rec.version).value is not None:
                    break
                lost += 1
    print(lost)
""")


def test_two_processes_never_lose_an_update(kv_server: RedisProcess) -> None:
    from cachestore.syncstore import SyncBlockStore  # noqa: PLC0415

    with SyncBlockStore(StoreSettings.from_url(kv_server.url, namespace="twoproc")) as store:
        assert store.write_session(SessionRecord("acme", "shared", "m"), None).value is not None
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, kv_server.url, name, str(n)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    gate = kv_server.client()
    assert gate.blpop(["twoproc-ready"], timeout=60) and gate.blpop(["twoproc-ready"], timeout=60)
    gate.rpush("twoproc-go-a", 1)
    gate.rpush("twoproc-go-b", 1)
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    lost = [int(o.strip()) for o in outputs]
    # the writers lost compare-and-sets and retried: the race the CAS exists for did happen
    assert sum(lost) > 0, lost
    with SyncBlockStore(StoreSettings.from_url(kv_server.url, namespace="twoproc")) as store:
        final = store.read_session("acme", "shared").value
    assert final is not None and final.version == 1 + 2 * n
    for name in ("a", "b"):
        assert [m["i"] for m in final.messages if m["writer"] == name] == list(range(n))
