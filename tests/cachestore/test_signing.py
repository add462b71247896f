"""Signed values (cachestore.signing) through a BlockStore on a real redis-server: blocks, landed blocks, tails and
reply ids, session records; values moved, copied, altered or unsigned are misses, counted; key rotation; the
trailer's bytes pinned."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from functools import partial

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cachestore.errors import ConfigError
from cachestore.hashing import BlockHash, ModelFingerprint, chain_hashes, root_hash
from cachestore.outcome import Outcome
from cachestore.sessions import FIELDS, SessionRecord, to_fields
from cachestore.settings import StoreSettings
from cachestore.signing import TRAILER_SIZE, Signer, signed_by
from cachestore.store import BlockStore
from cachestore.store.reads import Sealed
from cachestore.wire import Scatter
from cachestore.wire import native as native_wire
from ops.redisproc import RedisProcess
from tests.storekit import namespace_for, scratch_store

FP = ModelFingerprint("smollm2-135m", "tok1", "float32", 30, 3, 64, 16, "int8+none")
MODEL = FP.short()
KEY, OLD = "frame-key-7f3e", "frame-key-old-11aa"


def hashes_for(salt: bytes, n: int = 6) -> list[BlockHash]:
    return chain_hashes(list(range(16 * n)), 16, root_hash(FP, salt))


def settings(url: str, ns: str, key: str = KEY, previous: str = "") -> StoreSettings:
    return StoreSettings.from_url(url, namespace=ns, index_shards=4, frame_key=key, frame_key_previous=previous)


def make(url: str, ns: str, key: str = KEY, previous: str = "") -> BlockStore:
    return BlockStore(settings(url, ns, key, previous))


@pytest.fixture
async def store(shared_redis_server: RedisProcess, request: pytest.FixtureRequest) -> AsyncIterator[BlockStore]:
    async with scratch_store(settings(shared_redis_server.url, namespace_for(request, "sg-"))) as s:
        yield s


NONCE = bytes(range(12))
NAME = "kvstash:blk:m:00:{kvstash:s00}"


def test_trailer_golden() -> None:
    """The trailer's bytes for a fixed key, nonce, name and body: a change of the MAC's input or layout shows here."""
    signer = Signer(KEY)
    trailer = signer.trailer(signer.tag(NAME, (b"bo", b"dy"), nonce=NONCE))
    assert len(trailer) == TRAILER_SIZE == 36
    assert trailer.hex() == GOLDEN
    assert signer.open(NAME, b"body" + trailer) == b"body"
    sealed = signer.seal(NAME, b"body")
    assert sealed[:4] == b"body" and len(sealed) == 4 + TRAILER_SIZE
    assert signed_by(sealed) == signer.key_id and signed_by(b"body" * 20) is None


GOLDEN = "000102030405060708090a0bdf5de6e163880eb61b69f27d50d41ec69c32d6dd4b564d02"


def test_nonce_is_random_per_value() -> None:
    signer = Signer(KEY)
    one, two = signer.seal(NAME, b"body"), signer.seal(NAME, b"body")
    assert one != two and one[4:16] != two[4:16]
    assert signer.open(NAME, one) == b"body" and signer.open(NAME, two) == b"body"


def test_tag_is_aes_gmac_of_name_and_body() -> None:
    """The tag recomputed from its documented definition (cachestore/signing.py's table), with `cryptography`'s
    AES-GCM directly (an empty plaintext: its output is the tag of the additional data alone)."""
    name, body = "kvstash:tail:m:01:{kvstash:s01}", os.urandom(3000)
    key = blake3.blake3(KEY.encode(), derive_key_context="kvstash 2026-12 frame gmac key v2").digest()
    tag = AESGCM(key).encrypt(NONCE, b"", len(name).to_bytes(4, "little") + name.encode() + body)
    kid = blake3.blake3(key, derive_key_context="kvstash 2026-12 frame key id v1").digest()[:4]
    signer = Signer(KEY)
    assert signer.tag(name, (body,), nonce=NONCE) == NONCE + tag
    assert signer.open(name, body + NONCE + tag + kid + b"KVM\x02") == body


def test_version_1_trailer_is_signed_by_neither() -> None:
    """A value sealed before version 2 (keyed BLAKE3, 40-byte trailer) is a miss under the same secret."""
    name, body = NAME, os.urandom(500)
    key = blake3.blake3(KEY.encode(), derive_key_context="kvstash 2026-12 frame mac key v1").digest()
    tag = blake3.blake3(len(name).to_bytes(4, "little") + name.encode() + body, key=key).digest()
    kid = blake3.blake3(key, derive_key_context="kvstash 2026-12 frame key id v1").digest()[:4]
    old = body + tag + kid + b"KVM\x01"
    signer = Signer(KEY)
    assert signer.open(name, old) is None and signed_by(old) is None


def test_tampered_nonce_tag_or_body_fails() -> None:
    signer = Signer(KEY)
    sealed = signer.seal(NAME, os.urandom(2000))
    for at in (0, 1999, 2000, 2000 + 12, 2000 + 27):  # body, body's end, nonce, tag, tag's end
        bad = bytearray(sealed)
        bad[at] ^= 0x01
        assert signer.open(NAME, bytes(bad)) is None, at
    assert signer.open(NAME + "x", sealed) is None
    assert Signer("another key").open(NAME, sealed) is None


async def test_blocks_signed_and_moved(store: BlockStore) -> None:
    a, b = hashes_for(b"tenant-a"), hashes_for(b"tenant-b")
    frames = [os.urandom(900) for _ in a]
    assert (await store.store_blocks(MODEL, a, frames)).value == len(a)
    assert (await store.fetch(MODEL, a)).value == frames
    raw = store.client
    key = store.keys.block(MODEL, a[0])[1]
    stored = await raw.get(key)
    assert len(stored) == 900 + TRAILER_SIZE and stored[:900] == frames[0]
    # a well-formed signed value moved to another key (another tenant's block 0), and one unsigned: both misses
    await raw.set(store.keys.block(MODEL, b[0])[1], stored)
    assert (await store.fetch(MODEL, b[:1])).value == []
    await raw.set(key, frames[0])  # the body without its trailer
    assert (await store.fetch(MODEL, a)).value == []
    altered = bytearray(stored)
    altered[10] ^= 1
    await raw.set(key, bytes(altered))
    assert (await store.fetch(MODEL, a)).value == []
    await raw.set(key, stored)
    assert (await store.fetch(MODEL, a)).value == frames
    assert store.stats().rejected_mac == 3


def _landing(store: BlockStore, hashes: list[BlockHash], frames: list[bytes]) -> list[bytes | None]:
    arena = memoryview(bytearray(sum(len(f) for f in frames) + 64))
    at, targets = 0, []
    for i, f in enumerate(frames):
        if i % 2:  # every other one a Scatter of two pieces, reporting them (checksummed as they arrive)
            seen: list[int] = []
            targets.append(Scatter([arena[at + 100:at + len(f)], arena[at:at + 100]], lambda p, s=seen: s.append(1)))
        else:
            targets.append(arena[at:at + len(f)])
        at += len(f)
    result = store.fetch_blocking(MODEL, hashes, targets)
    out: list[bytes | None] = []
    for value, target in zip(result.value, targets, strict=False):
        assert value is target  # landed in the caller's buffer, the trailer apart
        out.append(value.tobytes())
    return out


async def test_landed_blocks_verified(store: BlockStore) -> None:
    hashes = hashes_for(b"land")
    frames = [os.urandom(700 + 10 * i) for i in range(len(hashes))]
    await store.store_blocks(MODEL, hashes, frames)
    got = await asyncio.to_thread(_landing, store, hashes, frames)
    assert got == frames
    key = store.keys.block(MODEL, hashes[3])[1]
    stored = bytearray(await store.client.get(key))
    stored[-TRAILER_SIZE - 1] ^= 0x80  # the body's last byte: the trailer no longer signs it
    await store.client.set(key, bytes(stored))
    assert len(await asyncio.to_thread(_landing, store, hashes, frames)) == 3
    assert store.stats().rejected_mac == 1


def test_a_landed_value_is_checked_as_its_trailer_lands() -> None:
    """A signed value landing in place is checked when its last piece (the trailer) lands, while the body is still in
    the cache; it is received as its unsigned body would be (natively, unless that body reports its pieces)."""
    signer, name = Signer(KEY), "kvstash:blk:x"
    body = os.urandom(native_wire.NATIVE_REPORTED_BYTES + 4096)
    value = signer.seal(name, body)
    for altered in (False, True):
        raw = bytearray(value)
        raw[len(body) // 2] ^= int(altered)
        sealed = Sealed(memoryview(bytearray(len(body))), partial(signer.check, name))
        assert native_wire.native_pieces(sealed) is not None
        assert sealed.verdict is None
        sealed.fill(raw)
        assert sealed.verdict is (not altered)
    reporting = Scatter([memoryview(bytearray(len(body)))], lambda piece: None)
    assert native_wire.native_pieces(Sealed(reporting, partial(signer.check, name))) is None
    assert native_wire.native_pieces(reporting) is None


async def test_entries_and_sessions(store: BlockStore) -> None:
    tail = store.keys.tail(MODEL, hashes_for(b"e")[0])
    ids = store.keys.reply_ids(MODEL, hashes_for(b"e")[1])
    assert await store.put_entries([tail, ids], [b"tail-value", b"ids-value"]) == 2
    assert await store.get_entries([tail, ids]) == [b"tail-value", b"ids-value"]
    await store.client.set(ids[1], await store.client.get(tail[1]))  # the tail's value under the ids key
    assert await store.get_entries([tail, ids]) == [b"tail-value", None]
    record = SessionRecord("alpha", "s1", MODEL, token_ids=[1, 2, 3], partial=b"\x00kv")
    assert (await store.write_session(record, None)).outcome is Outcome.STORED
    assert (await store.read_session("alpha", "s1")).value.token_ids == [1, 2, 3]  # type: ignore[union-attr]
    raw = store.client
    await raw.copy(store.keys.session("alpha", "s1"), store.keys.session("beta", "s1"))  # another tenant's key
    await raw.hset(store.keys.session("beta", "s1"), "tenant", "beta")
    assert (await store.read_session("beta", "s1")).outcome is Outcome.ABSENT
    await raw.hset(store.keys.session("alpha", "s1"), "token_ids", "AQAAAAIAAAAEAAAA")  # [1, 2, 4]
    assert (await store.read_session("alpha", "s1")).outcome is Outcome.ABSENT
    assert store.stats().rejected_mac == 3
    assert list(FIELDS) == to_fields(record, 0.0)[0::2]


async def test_rotation(shared_redis_server: RedisProcess) -> None:
    """Written under the old key: read by a store whose previous key it is, not by one that only knows the new."""
    url, ns = shared_redis_server.url, "sg-rotation"
    old, both, new = make(url, ns, OLD), make(url, ns, KEY, OLD), make(url, ns, KEY)
    try:
        first, second = hashes_for(b"r")[:3], hashes_for(b"r")[3:]
        frames = [os.urandom(500) for _ in range(6)]
        await old.store_blocks(MODEL, first, frames[:3])
        await both.store_blocks(MODEL, second, frames[3:])  # signed with the new key
        assert (await both.fetch(MODEL, first + second)).value == frames
        assert (await old.fetch(MODEL, first + second)).value == frames[:3]  # the old pod: not the new key's
        assert (await new.fetch(MODEL, second)).value == frames[3:]
        assert (await new.fetch(MODEL, first)).value == []
        assert (old.stats().rejected_mac, both.stats().rejected_mac, new.stats().rejected_mac) == (1, 0, 1)
    finally:
        await old.clear_namespace()
        for s in (old, both, new):
            await s.close()


def test_settings_mask_keys() -> None:
    s = StoreSettings.from_url("redis://h:1/0", frame_key=KEY, frame_key_previous=OLD)
    assert KEY not in repr(s) and OLD not in repr(s) and "frame_key='***'" in repr(s)
    with pytest.raises(ConfigError, match="not taken from a Redis URL"):
        StoreSettings.from_url(f"redis://h:1/0?frame_key={KEY}")
