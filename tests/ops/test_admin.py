"""`kvstash admin` against a real Redis populated through the real store: every command, --json, errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from cachestore.codec import Codec
from cachestore.hashing import ModelFingerprint, chain_hashes, root_hash
from cachestore.sessions import SessionRecord
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from ops.cli import main
from ops.redisproc import RedisCluster, RedisProcess, free_port
from tests.support import as_retired

FP = ModelFingerprint("tiny", "tok", "float32", 2, 2, 8, 16, "int8+lz4/g64")
OTHER = ModelFingerprint("other", "tok", "float32", 2, 2, 8, 16, "int8+lz4/g64")
CODEC = Codec("int8")


def frame(tokens: int = 16, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return CODEC.encode(torch.randn(2, 2, 2, tokens, 8, generator=g))  # [L, 2, H, T, D]


def populate(url: str, ns: str, **options: Any) -> dict[str, Any]:
    """Blocks of two models and three sessions, written through BlockStore as a pod would."""

    async def go() -> dict[str, Any]:
        store = BlockStore(StoreSettings.from_url(url, namespace=ns, **options))
        try:
            tokens = list(range(16 * 10 + 5))
            hashes = chain_hashes(tokens, 16, root_hash(FP, b"default"))
            assert (await store.store_blocks(FP.short(), hashes, [frame(seed=i) for i in range(10)])).value == 10
            other = chain_hashes(list(range(1000, 1064)), 16, root_hash(OTHER, b"default"))
            assert (await store.store_blocks(OTHER.short(), other, [frame(seed=50 + i) for i in range(4)])).value == 4
            for tenant, sid, model in (("default", "chat-1", FP), ("default", "chat-2", FP), ("acme", "a-1", OTHER)):
                rec = SessionRecord(tenant, sid, model.short(), tokens, [{"role": "user", "content": "hi " + sid}],
                                    partial=frame(5, seed=99))
                assert (await store.write_session(rec, None)).value is not None
            keys = [store.keys.block(FP.short(), h)[1] for h in hashes]
            return {"block_keys": keys, "other_keys": [store.keys.block(OTHER.short(), h)[1] for h in other]}
        finally:
            await store.close()

    return asyncio.run(go())


def admin(capsys: pytest.CaptureFixture[str], url: str, ns: str, *args: str) -> tuple[int, Any, str]:
    rc = main(["admin", "--redis-url", url, "--namespace", ns, *args])
    out, err = capsys.readouterr()
    try:
        parsed: Any = json.loads(out)
    except json.JSONDecodeError:
        parsed = out
    return rc, parsed, err


def test_stats_sessions_show(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    populate(redis_server.url, "st")
    rc, stats, _ = admin(capsys, redis_server.url, "st", "stats", "--json")
    assert rc == 0
    assert stats["kinds"]["block"]["keys"] == 14 and stats["kinds"]["session"]["keys"] == 3
    index_keys = sum(1 for _ in redis_server.client().scan_iter(match="st:idx:*"))
    assert stats["kinds"]["index"]["keys"] == index_keys > 0 and stats["kinds"]["other"]["keys"] == 0
    assert stats["models"][FP.short()] == {"blocks": 10, "block_bytes": 10 * len(frame()), "sessions": 2}
    assert stats["models"][OTHER.short()]["sessions"] == 1
    assert stats["budget"]["bytes_held"] == stats["budget"]["block_value_bytes"] == 14 * len(frame())
    assert stats["tenants"] == {"acme": 1, "default": 2}
    assert stats["oldest_block_access"] <= stats["newest_block_access"]
    assert stats["server"]["primaries"] == 1 and "keyspace_hits" in stats["server"]
    rc, text, _ = admin(capsys, redis_server.url, "st", "stats")
    assert rc == 0 and FP.short() in text and "budget:" in text

    rc, rows, _ = admin(capsys, redis_server.url, "st", "sessions", "--json")
    assert [(r["tenant"], r["session_id"]) for r in rows] == [("acme", "a-1"), ("default", "chat-1"),
                                                              ("default", "chat-2")]
    assert rows[1]["n_tokens"] == 165 and rows[1]["version"] == 1 and 0 < rows[1]["ttl_s"] <= 86400
    rc, rows, _ = admin(capsys, redis_server.url, "st", "sessions", "--tenant", "acme", "--json")
    assert [r["session_id"] for r in rows] == ["a-1"]

    rc, shown, _ = admin(capsys, redis_server.url, "st", "show", "chat-1", "--json")
    assert rc == 0 and shown["tokens"] == 165 and shown["partial"]["tokens"] == 5
    assert shown["messages"] == [{"role": "user", "content": "hi chat-1"}] and shown["token_ids"][:3] == [0, 1, 2]
    rc, text, _ = admin(capsys, redis_server.url, "st", "show", "a-1", "--tenant", "acme")
    assert rc == 0 and "hi a-1" in text
    rc, _, err = admin(capsys, redis_server.url, "st", "show", "nope")
    assert rc == 2 and err.startswith("kvstash: error: session default/nope not found")


def test_delete_asks_first(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    populate(redis_server.url, "del")
    client = redis_server.client()
    rc, _, err = admin(capsys, redis_server.url, "del", "delete", "chat-1")
    assert rc == 2 and "refusing without a terminal" in err and err.count("\n") == 1
    assert client.exists("del:sess:default:chat-1")
    rc, out, _ = admin(capsys, redis_server.url, "del", "delete", "chat-1", "--yes")
    assert rc == 0 and "deleted" in out and not client.exists("del:sess:default:chat-1")
    rc, _, err = admin(capsys, redis_server.url, "del", "delete", "chat-1", "--yes")
    assert rc == 2 and "not found" in err


def test_verify_finds_and_fixes(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    keys = populate(redis_server.url, "ver")
    rc, report, _ = admin(capsys, redis_server.url, "ver", "verify", "--json")
    assert rc == 0 and report["problems"] == {} and report["blocks_ok"] == 14 and report["sessions_ok"] == 3
    assert report["index_entries"] == 14

    client = redis_server.client()
    blocks = keys["block_keys"]
    bad = bytearray(client.get(blocks[0]))
    bad[-1] ^= 0xFF  # payload bit flip: only the checksum can tell
    client.set(blocks[0], bytes(bad), keepttl=True)
    client.set(blocks[1], b"garbage", keepttl=True)
    client.persist(blocks[2])
    tag = blocks[3][blocks[3].rfind("{"):]
    client.hdel(f"ver:idx:size:{tag}", blocks[3])  # unindexed (bytes no longer accounted)
    client.zrem(f"ver:idx:lru:{tag}", blocks[3])
    client.incrby(f"ver:idx:bytes:{tag}", -len(frame()))
    client.delete(blocks[4])  # leaves a stale index entry
    client.set(blocks[5], as_retired(client.get(blocks[5])), keepttl=True)  # what an older release wrote
    client.hset("ver:sess:default:chat-2", "n_tokens", "7")  # no longer matches token_ids
    client.set("ver:blk:zz:notahash:{ver:s00}", b"x", ex=100)
    rc, report, _ = admin(capsys, redis_server.url, "ver", "verify", "--json")
    assert rc == 1
    assert report["problems"] == {"bad_session": 1, "corrupt_block": 2, "dead_block": 6, "no_ttl": 1,
                                  "stale_index": 1, "unindexed_block": 1, "unreachable_block": 1, "retired_block": 1}
    dead = {f["key"] for f in report["findings"] if f["problem"] == "dead_block"}
    assert dead == set(blocks[4:])  # after the unindexed block 3: no lookup goes past it
    corrupt = {f["key"] for f in report["findings"] if f["problem"] == "corrupt_block"}
    assert corrupt == {blocks[0], blocks[1]}
    assert "checksum" in next(f["detail"] for f in report["findings"] if f["key"] == blocks[0])

    rc, _, err = admin(capsys, redis_server.url, "ver", "verify", "--fix")
    assert rc == 2 and "--yes" in err  # no terminal: refuses
    rc, report, _ = admin(capsys, redis_server.url, "ver", "verify", "--fix", "--yes", "--json")
    assert rc == 0 and all(f["fixed"] for f in report["findings"])
    assert not client.exists(blocks[0], blocks[1], "ver:sess:default:chat-2", "ver:blk:zz:notahash:{ver:s00}")
    assert not client.exists(*blocks[2:])  # the rest of a chain whose first blocks were corrupt: dead, reclaimed
    rc, report, _ = admin(capsys, redis_server.url, "ver", "verify", "--json")
    assert rc == 0 and report["problems"] == {} and report["blocks_ok"] == 4
    rc, stats, _ = admin(capsys, redis_server.url, "ver", "stats", "--json")
    assert stats["budget"]["bytes_held"] == stats["budget"]["block_value_bytes"] == 4 * len(frame())
    assert stats["budget"]["dead_bytes"] == 0


def test_evict_and_purge(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str]) -> None:
    keys = populate(redis_server.url, "ev")
    client = redis_server.client()
    size = len(frame())
    rc, out, _ = admin(capsys, redis_server.url, "ev", "evict", "--to-bytes", str(10 * size), "--yes")
    assert rc == 0 and "now" in out
    rc, stats, _ = admin(capsys, redis_server.url, "ev", "stats", "--json")
    assert stats["budget"]["bytes_held"] == stats["budget"]["block_value_bytes"] <= 10 * size
    assert stats["kinds"]["block"]["keys"] == 10
    assert client.exists(*keys["other_keys"]) == 4  # written last, so most recently used

    rc, _, err = admin(capsys, redis_server.url, "ev", "purge", "--model", "not a model!", "--yes")
    assert rc == 2 and "model id" in err
    rc, out, _ = admin(capsys, redis_server.url, "ev", "purge", "--model", OTHER.short(), "--yes")
    assert rc == 0 and "4 blocks" in out and "1 sessions" in out
    rc, stats, _ = admin(capsys, redis_server.url, "ev", "stats", "--json")
    assert OTHER.short() not in stats["models"] and stats["models"][FP.short()]["sessions"] == 2
    assert stats["budget"]["bytes_held"] == stats["budget"]["block_value_bytes"] == 6 * size


def test_errors_are_one_line_and_mask_the_password(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"redis://admin:s3cret-pw@127.0.0.1:{free_port()}/0"
    rc, _, err = admin(capsys, url, "x", "stats")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvstash: error: Redis at redis://admin:***@")
    assert "s3cret" not in err
    monkeypatch.delenv("KVSTASH_REDIS_URL", raising=False)
    assert main(["admin", "stats"]) == 2
    assert "pass --redis-url or set KVSTASH_REDIS_URL" in capsys.readouterr().err


def test_acl_user_from_env(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    populate(redis_server.url, "acl")
    redis_server.client().acl_setuser("ops", enabled=True, passwords=["+pw-123"], keys=["acl:*"],
                                      commands=["+@all", "-@dangerous", "+info", "+memory"])
    monkeypatch.setenv("KVSTASH_REDIS_URL", f"redis://ops:pw-123@127.0.0.1:{redis_server.port}/0")
    assert main(["admin", "--namespace", "acl", "sessions", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    monkeypatch.setenv("KVSTASH_REDIS_URL", f"redis://ops:wrong@127.0.0.1:{redis_server.port}/0")
    assert main(["admin", "--namespace", "acl", "sessions"]) == 2
    err = capsys.readouterr().err
    assert "wrong" not in err and "kvstash: error: Redis at redis://ops:***@" in err


@pytest.mark.cluster
def test_stats_and_verify_on_a_cluster(redis_cluster: RedisCluster, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster.nodes[0].port}"
    keys = populate(url, "adm")
    rc, stats, _ = admin(capsys, url, "adm", "stats", "--json")
    assert rc == 0 and stats["server"]["primaries"] == 3
    assert stats["kinds"]["block"]["keys"] == 14 and stats["kinds"]["session"]["keys"] == 3
    assert stats["budget"]["bytes_held"] == 14 * len(frame())
    node_of = {n.port: n.client() for n in redis_cluster.nodes}
    victim = keys["block_keys"][5]
    for node in node_of.values():  # write the bad bytes on whichever primary owns the slot
        try:
            node.set(victim, b"KVS1" + b"\0" * 60, keepttl=True)
            break
        except Exception:  # noqa: BLE001 - MOVED from the other primaries
            continue
    rc, report, _ = admin(capsys, url, "adm", "verify", "--json")
    assert rc == 1 and report["problems"] == {"corrupt_block": 1} and report["findings"][0]["key"] == victim
    rc, report, _ = admin(capsys, url, "adm", "verify", "--fix", "--yes", "--json")
    assert rc == 0
    assert {f["key"] for f in report["findings"] if f["problem"] == "dead_block"} == set(keys["block_keys"][6:])
    rc, report, _ = admin(capsys, url, "adm", "verify", "--json")
    assert rc == 0 and report["blocks_ok"] == 9  # the blocks after the corrupt one were dead: reclaimed too


def test_verify_on_a_signed_namespace(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pods' frame keys, verify checks every value's MAC under the current and the previous key and
    reports (and with --fix deletes) those signed by neither, unsigned, or moved; without a key it leaves them."""
    from cachestore.signing import Signer  # noqa: PLC0415

    keys = populate(redis_server.url, "sig", frame_key="key-A")
    url, blocks = redis_server.url, keys["block_keys"]
    monkeypatch.setenv("KVSTASH_FRAME_KEY", "key-B")
    monkeypatch.setenv("KVSTASH_FRAME_KEY_PREVIOUS", "key-A")  # mid-rotation: everything is signed by the old key
    rc, report, _ = admin(capsys, url, "sig", "verify", "--json")
    assert rc == 0 and report["problems"] == {} and report["blocks_ok"] == 14 and report["sessions_ok"] == 3
    assert report["signed_by"] == {"previous": 17}

    client = redis_server.client()
    client.set(blocks[0], client.get(blocks[1]), keepttl=True)  # a valid value moved onto another block's key
    client.set(blocks[2], Signer("key-D").seal(blocks[2], frame(seed=2)), keepttl=True)  # another deployment's key
    client.set(blocks[3], frame(seed=3), keepttl=True)  # a well-formed unsigned frame, checksum and all
    client.set(blocks[4], Signer("key-B").seal(blocks[4], frame(seed=4)), keepttl=True)  # the new key: fine
    client.hset("sig:sess:default:chat-1", "mac", client.hget("sig:sess:default:chat-2", "mac"))  # another's MAC
    rc, report, _ = admin(capsys, url, "sig", "verify", "--json")
    assert rc == 1 and report["problems"] == {"bad_signature": 4}
    details = {f["key"]: f["detail"] for f in report["findings"]}
    assert "moved from another key or altered" in details[blocks[0]]
    assert "neither the current nor the previous" in details[blocks[2]]
    assert "not signed" in details[blocks[3]]
    assert "sig:sess:default:chat-1" in details
    assert report["signed_by"] == {"current": 1, "previous": 12}

    monkeypatch.setenv("KVSTASH_FRAME_KEY", "key-C")  # a pod with neither key: every value is signed by neither
    monkeypatch.delenv("KVSTASH_FRAME_KEY_PREVIOUS")
    rc, report, _ = admin(capsys, url, "sig", "verify", "--json")
    assert rc == 1 and report["problems"] == {"bad_signature": 17} and report["signed_by"] == {}

    monkeypatch.delenv("KVSTASH_FRAME_KEY")  # no key at all: signed values are reported, never deleted
    rc, report, _ = admin(capsys, url, "sig", "verify", "--fix", "--yes", "--json")
    assert report["problems"] == {"signed_value": 13} and not any(
        f["fixed"] for f in report["findings"] if f["problem"] == "signed_value")
    assert client.exists(*blocks[5:]) == len(blocks[5:])

    monkeypatch.setenv("KVSTASH_FRAME_KEY", "key-B")
    monkeypatch.setenv("KVSTASH_FRAME_KEY_PREVIOUS", "key-A")
    rc, report, _ = admin(capsys, url, "sig", "verify", "--fix", "--yes", "--json")
    assert rc == 0 and report["problems"] == {"bad_signature": 4, "dead_block": 7}  # the chain after blocks[0]
    assert not client.exists(blocks[0], blocks[2], blocks[3], "sig:sess:default:chat-1")
    rc, report, out = admin(capsys, url, "sig", "verify")
    assert rc == 0 and "signed by the current key: 0, by the previous key: 6" in report


def test_stats_show_bytes_held_per_tenant(redis_server: RedisProcess, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async def write() -> int:
        store = BlockStore(StoreSettings.from_url(redis_server.url, namespace="ten"))
        try:
            hashes = chain_hashes(list(range(16 * 3)), 16, root_hash(FP, b"acme"))
            assert (await store.store_blocks(FP.short(), hashes, [frame(seed=i) for i in range(3)], "acme")).value == 3
            other = chain_hashes(list(range(16)), 16, root_hash(FP, b"beta"))
            assert (await store.store_blocks(FP.short(), other, [frame(seed=9)], "beta")).value == 1
            return len(frame())
        finally:
            await store.close()

    size = asyncio.run(write())
    monkeypatch.setenv("KVSTASH_TENANT_QUOTAS", "acme=1MiB")
    rc, stats, _ = admin(capsys, redis_server.url, "ten", "stats", "--json")
    assert rc == 0 and stats["tenant_bytes"] == {"acme": 3 * size, "beta": size}
    assert stats["tenant_quotas"] == {"acme": 1 << 20}
    rc, out, _ = admin(capsys, redis_server.url, "ten", "stats")
    assert rc == 0 and "acme" in out and "1.0 MiB" in out and "none" in out
