"""Values received straight into the caller's buffer (cachestore.wire), against a real redis-server, and the
frames of a lookup dequantized a layer of every block at a time from there (FrameRun, Rehydration)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
import torch

from cachestore import wire
from cachestore.codec import Codec, FrameRun
from cachestore.codec.arrays import to_host
from cachestore.errors import CodecError
from cachestore.hashing import BlockHash
from cachestore.outcome import Outcome
from cachestore.settings import StoreSettings
from cachestore.store import BlockStore
from cachestore.wire import native as native_wire
from ops.redisproc import RedisProcess
from service.cache.rehydrate import Rehydration
from tests.timing import wait_for_async

MODES = ["exact", "fp16", "int8", "int4+none", "int2+none", "int4+none/rotv", "int2+none/g8"]


class Trickle:
    """A socket that hands out what it holds `step` bytes at a time: every header and value split mid-way."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step, self.at = data, step, 0

    def recv_into(self, buf: memoryview, nbytes: int = 0) -> int:
        n = min(self.step, len(buf), nbytes or len(buf), len(self.data) - self.at)
        buf[:n] = self.data[self.at:self.at + n]
        self.at += n
        return n


REPLIES = (b"$5\r\nhello\r\n$-1\r\n_\r\n:42\r\n+OK\r\n-WRONGTYPE no\r\n*2\r\n:1\r\n$2\r\nab\r\n%1\r\n+k\r\n:7\r\n"
           b"#t\r\n,1.5\r\n(12345678901234567890\r\n=8\r\ntxt:four\r\n!5\r\noops!\r\n~1\r\n:3\r\n|1\r\n+a\r\n:0\r\n"
           b"$3\r\nxyz\r\n*-1\r\n")


@pytest.mark.parametrize("step", [1, 3, 7, 1 << 16])
def test_every_reply_type_parses_however_the_bytes_arrive(step: int) -> None:
    buf = bytearray(3)
    reader = wire.make_parser(Trickle(REPLIES, step))  # type: ignore[arg-type]
    got = [reader.reply(memoryview(buf) if i == 0 else None) for i in range(16)]
    assert got[0] == b"hello"  # 5 bytes do not fit a 3-byte target: a bytes object of their own
    assert got[1:5] == [None, None, 42, b"OK"]
    assert isinstance(got[5], redis.ResponseError) and str(got[5]) == "WRONGTYPE no"
    assert got[6:13] == [[1, b"ab"], {b"k": 7}, True, 1.5, 12345678901234567890, b"four", got[12]]
    assert isinstance(got[12], redis.ResponseError) and str(got[12]) == "oops!"
    assert got[13] == [3]
    target = memoryview(buf)
    reader2 = wire.make_parser(Trickle(b"|1\r\n+a\r\n:0\r\n$3\r\nxyz\r\n", step))  # type: ignore[arg-type]
    assert reader2.reply(target) is target and bytes(buf) == b"xyz"  # after its attributes, into the target
    assert got[14] == b"xyz" and got[15] is None
    assert reader.buffered == 0


@pytest.mark.parametrize("bad", [b"$5\r\nhello!!", b"?what\r\n", b"$x\r\n", b"$5\r\nhel", b"$99999999999\r\n",
                                 b"*1\r\n" * 12 + b":1\r\n"])
def test_a_malformed_or_cut_reply_raises(bad: bytes) -> None:
    reader = wire.make_parser(Trickle(bad, 2))  # type: ignore[arg-type]
    with pytest.raises(redis.ConnectionError):
        reader.reply()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("protocol", [2, 3])
def test_values_of_the_slot_length_land_in_the_buffer(kv_server: RedisProcess, protocol: int, native: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[int] = []
    if not native:
        monkeypatch.setattr(native_wire, "_resp", None)  # every reply parsed in Python
    elif not wire.NATIVE:
        pytest.skip("cachestore._resp not built")
    else:
        import cachestore._resp as resp  # noqa: PLC0415

        def counted(*args: Any) -> tuple[int, int, int, int, int]:
            got = resp.receive(*args)
            runs.append(got[0] - args[7])  # replies it received
            return got

        monkeypatch.setattr(native_wire, "_resp", SimpleNamespace(receive=counted))
    client = redis.Redis.from_url(kv_server.url, protocol=protocol)
    try:
        big, small = os.urandom(3_000_000), os.urandom(1000)  # far larger than the reader's own buffer
        client.set("big", big)
        client.set("small", small)
        buf = bytearray(3_000_000 + 2000)
        view = memoryview(buf)
        slots = [view[:3_000_000], view[3_000_000:3_001_000], view[3_001_000:3_001_500]]
        replies = wire.pipelined_into(
            client, [("GETEX", "big", "PX", 60_000), ("GET", "small"), ("GET", "small"), ("GET", "absent"),
                     ("EVAL", "return {1, 'two'}", 0), ("INCR", "big")], slots)
        assert replies[0] is slots[0] and replies[1] is slots[1]  # landed: the slots themselves
        assert bytes(buf[:3_000_000]) == big and bytes(buf[3_000_000:3_001_000]) == small
        assert replies[2] == small and bytes(buf[3_001_000:3_001_500]) == bytes(500)  # 1000 bytes, a 500 slot
        assert replies[3] is None and replies[4] == [1, b"two"]
        assert isinstance(replies[5], redis.ResponseError)
        assert client.pttl("big") > 0 and client.get("small") == small  # the connection is clean afterwards
        assert runs == ([2] if native else [])  # natively, in one run: the two of their slot's length
    finally:
        client.close()


@pytest.mark.parametrize("step", [1, 5, 1 << 16])
def test_a_scatter_receives_a_value_across_its_pieces_in_order(step: int) -> None:
    """A bulk string of a Scatter's length lands across its pieces, each handed to `filled` once it is whole, in
    order, however the bytes arrive; one of another length comes back as bytes and fills nothing."""
    value = bytes(range(7)) * 5  # 35 bytes
    data = b"$35\r\n" + value + b"\r\n$4\r\nabcd\r\n"
    buf = bytearray(40)
    view = memoryview(buf)
    seen: list[bytes] = []
    scatter = wire.Scatter([view[30:33], view[0:20], view[25:30], view[20:25], view[33:35]],
                              lambda piece: seen.append(bytes(piece)))
    other = wire.Scatter([view[35:40]], lambda piece: seen.append(b"no"))
    reader = wire.make_parser(Trickle(data, step))  # type: ignore[arg-type]
    assert reader.reply(scatter) is scatter and reader.reply(other) == b"abcd"
    assert seen == [value[:3], value[3:23], value[23:28], value[28:33], value[33:]]
    assert bytes(buf[30:33]) == value[:3] and bytes(buf[0:20]) == value[3:23] and scatter.tobytes() == value
    assert bytes(buf[35:40]) == bytes(5)
    filled: list[bytes] = []
    again = wire.Scatter([memoryview(bytearray(2)), memoryview(bytearray(3))], lambda p: filled.append(bytes(p)))
    again.fill(b"hello")
    assert filled == [b"he", b"llo"] and again.tobytes() == b"hello"
    with pytest.raises(ValueError, match="4 bytes"):
        again.fill(b"four")


async def test_fetch_blocking_receives_frames_across_scatters(kv_server: RedisProcess) -> None:
    """Through the store (and its local tier): a frame of a Scatter's length comes back as that Scatter, its bytes
    across the pieces; from the local tier it is copied across them the same way."""
    writer, store = _store(kv_server.url, "scatter"), _store(kv_server.url, "scatter", local=1 << 20)
    try:
        hashes = [BlockHash(bytes([i]) * 16) for i in range(3)]
        frames = [os.urandom(4000) for _ in range(3)]
        assert (await writer.store_blocks("abcdef0123456789", hashes, frames)).value == 3
        for _ in range(2):  # from Redis, then from the local tier
            buf = bytearray(3 * 4000)
            view = memoryview(buf)
            targets = [wire.Scatter([view[i * 4000 + 1000:(i + 1) * 4000], view[i * 4000:i * 4000 + 1000]])
                       for i in range(3)]
            got = (await asyncio.to_thread(store.fetch_blocking, "abcdef0123456789", hashes, targets)).value
            assert all(g is t for g, t in zip(got, targets, strict=True))
            assert [g.tobytes() for g in got] == frames  # type: ignore[union-attr]
            assert bytes(buf[1000:4000]) == frames[0][:3000] and bytes(buf[:1000]) == frames[0][3000:]
        assert store.stats().local_hits == 3
    finally:
        await writer.clear_namespace()
        await writer.close()
        await store.close()


def test_a_server_gone_mid_reply_raises_and_the_pool_recovers(kv_server: RedisProcess) -> None:
    client = redis.Redis.from_url(kv_server.url, socket_timeout=5)
    try:
        client.set("v", b"x" * 100)
        with pytest.raises(redis.ConnectionError):  # the connection closes before its replies
            wire.pipelined_into(client, [("CLIENT", "KILL", "SKIPME", "no"), ("GET", "v")], [])
        assert client.get("v") == b"x" * 100
    finally:
        client.close()


def _store(url: str, ns: str, local: int = 0) -> BlockStore:
    return BlockStore(StoreSettings.from_url(url, namespace=ns, index_shards=2, local_tier_bytes=local))


async def test_fetch_blocking_receives_frames_into_their_slots(kv_server: RedisProcess) -> None:
    """Frames of their slot's length land in it; any other length comes back as bytes; the hit ends at the first
    missing block; what a lookup reads goes on counting as before; the local tier keeps copies, not the slots."""
    writer, store = _store(kv_server.url, "land"), _store(kv_server.url, "land", local=1 << 20)
    try:
        hashes = [BlockHash(bytes([i]) * 16) for i in range(5)]
        frames = [os.urandom(4000) for _ in range(4)] + [os.urandom(3000)]
        assert (await writer.store_blocks("abcdef0123456789", hashes, frames)).value == 5
        buf = bytearray(5 * 4096)
        slots = [memoryview(buf)[i * 4096:i * 4096 + 4000] for i in range(5)]
        got = (await asyncio.to_thread(store.fetch_blocking, "abcdef0123456789", hashes, slots)).value
        assert [type(g) for g in got] == [memoryview] * 4 + [bytes]
        assert all(g is s for g, s in zip(got[:4], slots[:4], strict=True)) and [bytes(g) for g in got] == frames
        assert store.stats().bytes_read == 19_000 and store.stats().local_hits == 0
        buf[:] = bytes(len(buf))  # the slots are reused: the local tier holds its own copies
        again = (await asyncio.to_thread(store.fetch_blocking, "abcdef0123456789", hashes[:3], slots)).value
        assert [bytes(g) for g in again] == frames[:3] and again[0] is slots[0]  # from the local tier, into the slot
        assert store.stats().local_hits == 3
        await writer.client.delete(writer.keys.block("abcdef0123456789", hashes[2])[1])
        hole = (await asyncio.to_thread(writer.fetch_blocking, "abcdef0123456789", hashes, slots)).value
        assert [bytes(g) for g in hole] == frames[:2]
        assert writer.stats().bytes_read == 8000 and writer.stats().partial_hits == 1
    finally:
        await writer.clear_namespace()
        await writer.close()
        await store.close()


def _landed(codec: Codec, kvs: list[torch.Tensor], stride: int, host: bool = False
            ) -> tuple[torch.Tensor | np.ndarray, list[memoryview]]:
    """The frames of `kvs` received into one landing at `stride`: a torch buffer (hf's), or with `host` a numpy one
    (llama.cpp's engines and the sidecar: `KvGeometry.dtype` is numpy's)."""
    frames = [codec.encode(kv) for kv in kvs]
    buf = np.zeros(len(frames) * stride, dtype=np.uint8) if host else torch.zeros(len(frames) * stride,
                                                                                  dtype=torch.uint8)
    view = memoryview(buf if host else buf.numpy())
    slots = []
    for i, frame in enumerate(frames):
        view[i * stride:i * stride + len(frame)] = frame
        slots.append(view[i * stride:i * stride + len(frame)])
    return buf, slots


@pytest.mark.parametrize("mode", MODES)
def test_a_layer_of_every_landed_frame_at_once_equals_the_frames_decoded_one_by_one(mode: str) -> None:
    gen = torch.Generator().manual_seed(3)
    codec = Codec(mode)
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(5)]  # [L, 2, H, T, D] each
    buf, slots = _landed(codec, kvs, -(-codec.plain_size((4, 2, 3, 16, 64), torch.float32) // 64) * 64)
    run = FrameRun.of(buf, [codec.open(s) for s in slots])
    assert run is not None and run.count == 5
    want = torch.cat([codec.decode(bytes(s), device="cpu").float() for s in slots], dim=3)  # [L, 2, H, 5 * 16, D]
    context = torch.full((4, 2, 3, 5 * 16 + 9, 64), float("nan"))
    for layer in (2, 0, 3, 1):  # any order: each call writes its layer only
        out = context[layer, :, :, :80].view(2, 3, 5, 16, 64).permute(2, 0, 1, 3, 4)  # [frames, 2, H, T, D]
        assert run.decode_layer_into(out, layer) is out
        assert torch.equal(context[layer, :, :, :80], want[layer])
    assert torch.equal(context[:, :, :, :80], want) and context[:, :, :, 80:].isnan().all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("into", ["fp32", "state"])
def test_every_layer_of_a_run_at_once_equals_the_frames_decoded_one_by_one(mode: str, into: str) -> None:
    """`FrameRun.decode_into`: the whole run into its tokens of a context (fp32, as hf's), or of a llama.cpp sequence
    state's fp16 view (int8 takes one kernel call for all the keys and one for all the values there)."""
    from service.engines.llama import llamastate, statewrite  # noqa: PLC0415

    gen = torch.Generator().manual_seed(5)
    codec = Codec(mode)
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(5)]
    stride = -(-codec.plain_size((4, 2, 3, 16, 64), torch.float32) // 64) * 64
    buf, slots = _landed(codec, kvs, stride, host=into == "state")
    run = FrameRun.of(buf, [codec.open(s) for s in slots])
    assert run is not None
    context: torch.Tensor | np.ndarray
    if into == "state":  # numpy throughout, as in the sidecar
        made = statewrite.state_view(5 * 16 + 9, llamastate.StateGeometry(4, 3, 64, False, 1, llamastate.GGML_TYPE_F16))
        assert made is not None
        context = made[1]  # [L, 2, H, 89, D] fp16, strided over the state's headers
        context.fill(float("nan"))
        spare: torch.Tensor | np.ndarray = np.full((4, 2, 3, 79, 64), np.nan, dtype=np.float32)
    else:
        context = torch.full((4, 2, 3, 5 * 16 + 9, 64), float("nan"))
        spare = torch.full((4, 2, 3, 79, 64), float("nan"))
    want = np.concatenate([codec.decode(bytes(s)).astype(to_host(context).dtype) for s in slots], axis=3)
    assert run.decode_into(context[:, :, :, 2:82]) is not None
    got = to_host(context)  # [L, 2, H, 89, D], the hit at tokens 2..81
    assert np.array_equal(got[:, :, :, 2:82], want)
    assert np.isnan(got[:, :, :, :2]).all() and np.isnan(got[:, :, :, 82:]).all()
    with pytest.raises(CodecError):  # a view of another length: refused, nothing written
        run.decode_into(spare)
    assert np.isnan(to_host(spare)).all()


def test_frames_that_are_no_run() -> None:
    gen = torch.Generator().manual_seed(4)
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(3)]
    codec = Codec("int8")
    buf, slots = _landed(codec, kvs, 26_624)
    opened = [codec.open(s) for s in slots]
    assert FrameRun.of(buf, opened) is not None
    assert FrameRun.of(buf, [opened[0], opened[2], opened[1]]) is None  # not at one stride
    assert FrameRun.of(buf, [codec.open(bytes(s)) for s in slots]) is None  # not read in place from the buffer
    assert FrameRun.of(torch.zeros(10, dtype=torch.uint8), opened) is None  # in place, but elsewhere
    other = Codec("fp16")
    buf2, slots2 = _landed(other, kvs[:1], 50_000)
    assert FrameRun.of(buf, [opened[0], other.open(slots2[0])]) is None  # two kinds
    mixed = Codec("int4+none/symv/s8/k5=0.1")  # layers one bit more: codes of two kinds per frame
    buf3, slots3 = _landed(mixed, kvs, 20_480)
    assert FrameRun.of(buf3, [mixed.open(s) for s in slots3]) is None


def _six_landed(seed: int) -> tuple[torch.Generator, Codec, torch.Tensor, list[memoryview], torch.Tensor, torch.Tensor]:
    """Six int8 blocks of 16 tokens landed in one buffer: (generator, codec, buffer, slots, what they decode to, a NaN
    context with room for 16 more tokens)."""
    gen = torch.Generator().manual_seed(seed)
    codec = Codec("int8")
    buf, slots = _landed(codec, [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(6)], 26_624)
    want = torch.cat([codec.decode(bytes(s), device="cpu").float() for s in slots], dim=3)
    return gen, codec, buf, slots, want, torch.full((4, 2, 3, 6 * 16 + 16, 64), float("nan"))


def test_a_rehydration_leaves_landed_frames_for_the_forward_step_a_layer_at_a_time() -> None:
    """Landed frames are only verified while the lookup reads; each layer of all of them is dequantized when the
    forward step reaches it; a frame that did not land (bytes) is dequantized whole, before layer 0."""
    _, codec, buf, slots, want, out = _six_landed(5)
    rehydration = Rehydration(out, 16, lambda frame, i: codec.open(frame), layerwise=True, landing=buf)
    rehydration.feed(slots[:2])
    rehydration.feed([bytes(slots[2])] + slots[3:])  # block 2 came as bytes (a frame of another length would)
    rehydration.end()
    verified: list[tuple[int, int]] = []
    rehydration.run(lambda n, nbytes: verified.append((n, nbytes)))
    assert verified == [(6, sum(map(len, slots)))]
    assert out[:, :, :, :96].isnan().all()  # nothing dequantized yet: it waits for the forward step
    rehydration.gate.wait(0)
    assert torch.equal(out[0, :, :, :96], want[0]) and torch.equal(out[:, :, :, 32:48], want[:, :, :, 32:48])
    assert out[1:, :, :, :32].isnan().all() and out[1:, :, :, 48:96].isnan().all()
    rehydration.gate.wait_all()
    assert torch.equal(out[:, :, :, :96], want)


def test_block_zero_of_another_codec_is_a_run_of_its_own() -> None:
    """Under int4 block 0 keeps int8 (blockcodec): its frame is a run of its own and the int4 frames another, so
    every block is still dequantized a layer at a time."""
    gen = torch.Generator().manual_seed(6)
    sink, main = Codec("int8"), Codec("int4+none")
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(4)]
    frames = [sink.encode(kvs[0])] + [main.encode(kv) for kv in kvs[1:]]
    buf = torch.zeros(4 * 26_624, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    slots = [view[0:len(frames[0])]] + [view[26_624 * i:26_624 * i + len(f)] for i, f in enumerate(frames) if i]
    for slot, frame in zip(slots, frames, strict=True):
        slot[:] = frame
    want = torch.cat([Codec().decode(f, device="cpu").float() for f in frames], dim=3)
    out = torch.full((4, 2, 3, 4 * 16, 64), float("nan"))
    rehydration = Rehydration(out, 16, lambda frame, i: Codec().open(frame), layerwise=True, landing=buf)
    rehydration.take(slots)
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    rehydration.gate.wait(1)
    assert torch.equal(out[:2], want[:2]) and out[2:].isnan().all()  # block 0 too: by layer, not whole
    rehydration.gate.wait_all()
    assert torch.equal(out, want)


async def _until_connected_clients(store: BlockStore, want: int, timeout_s: float = 5.0) -> None:
    """Until Redis counts `want` connected clients: the server notices a closed socket on its next event loop turn,
    not before the client's close returns."""

    async def counted() -> bool:
        return int((await store.client.info("clients"))["connected_clients"]) == want

    await wait_for_async(counted, f"{want} connected clients", timeout_s, poll_s=0.01)


async def test_chunks_are_requested_one_ahead_and_answer_as_fetch_blocking(kv_server: RedisProcess) -> None:
    """fetch_chunks_blocking yields what fetch_blocking gives chunk by chunk (frames in their slots, local frames
    copied in, the hit ending at a hole); closed early it drops the connection of the request left unanswered."""
    store = _store(kv_server.url, "ahead", local=1 << 20)
    try:
        hashes = [BlockHash(bytes([i]) * 16) for i in range(7)]
        frames = [os.urandom(3000) for _ in range(7)]
        assert (await _store(kv_server.url, "ahead").store_blocks("abcdef0123456789", hashes, frames)).value == 7
        buf = bytearray(7 * 4096)
        slots = [memoryview(buf)[i * 4096:i * 4096 + 3000] for i in range(7)]
        chunks, into = [hashes[0:3], hashes[3:6], hashes[6:7]], [slots[0:3], slots[3:6], slots[6:7]]

        def fetch_all() -> list[list[object]]:
            return [r.value for r in store.fetch_chunks_blocking("abcdef0123456789", chunks, into)]

        got = await asyncio.to_thread(fetch_all)
        assert [[bytes(f) for f in c] for c in got] == [frames[0:3], frames[3:6], frames[6:7]]
        assert all(f is s for c, sl in zip(got, into, strict=True) for f, s in zip(c, sl, strict=True))
        stats = store.stats()
        assert (stats.lookups, stats.hits, stats.round_trips, stats.errors) == (3, 3, 3, 0)
        buf[:] = bytes(len(buf))
        again = await asyncio.to_thread(fetch_all)  # all from the local tier now: no round trip, into the slots
        assert [[bytes(f) for f in c] for c in again] == [frames[0:3], frames[3:6], frames[6:7]]
        assert store.stats().round_trips == 3 and store.stats().local_hits == 7

        cold = _store(kv_server.url, "ahead")
        try:
            await cold.client.delete(cold.keys.block("abcdef0123456789", hashes[4])[1])

            def with_hole() -> list[list[object]]:
                return [r.value for r in cold.fetch_chunks_blocking("abcdef0123456789", chunks, into)]

            hole = await asyncio.to_thread(with_hole)  # the second chunk ends at block 4: no third chunk
            assert [[bytes(f) for f in c] for c in hole] == [frames[0:3], frames[3:4]]
            assert cold.stats().round_trips == 2 and cold.stats().partial_hits == 1

            def first_only() -> int:
                results = cold.fetch_chunks_blocking("abcdef0123456789", chunks, into)
                first = next(results)  # the second chunk is already asked for
                results.close()
                return len(first.value)

            clients = int((await cold.client.info("clients"))["connected_clients"])
            assert await asyncio.to_thread(first_only) == 3
            await _until_connected_clients(cold, clients - 1)  # dropped
            assert [bytes(f) for f in (await asyncio.to_thread(with_hole))[0]] == frames[0:3]  # a new one
        finally:
            await cold.close()
    finally:
        await store.clear_namespace()
        await store.close()


async def test_a_server_killed_between_chunks_is_a_miss_for_the_breaker(kv_server: RedisProcess) -> None:
    """The second chunk (12 MB, more than a socket's receive buffer holds) was asked for, then Redis dies: the first
    chunk counts, the second is UNAVAILABLE and the breaker hears of it."""
    store = BlockStore(StoreSettings.from_url(kv_server.url, namespace="gone", op_timeout_s=0.5,
                                              connect_timeout_s=0.3, breaker_failures=1, breaker_reset_s=30))
    try:
        size = 4 << 20
        hashes = [BlockHash(bytes([i]) * 16) for i in range(5)]
        frames = [os.urandom(size) for _ in range(5)]
        assert (await store.store_blocks("abcdef0123456789", hashes, frames)).value == 5
        buf = bytearray(5 * size)
        slots = [memoryview(buf)[i * size:(i + 1) * size] for i in range(5)]

        def killed_after_first() -> list[Any]:
            results = store.fetch_chunks_blocking("abcdef0123456789", [hashes[:2], hashes[2:]], [slots[:2], slots[2:]])
            first = next(results)
            kv_server.kill()
            return [first, *results]

        first, second = await asyncio.to_thread(killed_after_first)
        assert [bytes(f) for f in first.value] == frames[:2] and first.value[0] is slots[0]
        assert second.outcome is Outcome.UNAVAILABLE and store.breaker_state == "open"
        assert store.stats().errors == 1
        gone = await asyncio.to_thread(
            lambda: list(store.fetch_chunks_blocking("abcdef0123456789", [hashes[:2]], [slots[:2]])))
        assert [r.outcome for r in gone] == [Outcome.UNAVAILABLE] and store.stats().skipped_open == 1
    finally:
        await store.close()


def test_an_engine_that_takes_its_state_whole_gets_landed_frames_dequantized_during_the_fetch() -> None:
    """llama.cpp's frames land too (one copy on the wire), but its rehydration thread dequantizes them whole as they
    come: by the time the hit is known every layer is in place, nothing is handed over."""
    gen = torch.Generator().manual_seed(7)
    codec = Codec("int8")
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(3)]
    buf, slots = _landed(codec, kvs, 26_624)
    want = torch.cat([codec.decode(bytes(s), device="cpu").float() for s in slots], dim=3)
    out = torch.full((4, 2, 3, 48, 64), float("nan"))
    rehydration = Rehydration(out, 16, lambda frame, i: codec.open(frame), layerwise=False, landing=buf)
    rehydration.feed(slots)
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    assert torch.equal(out, want)  # before anyone waits on the gate
    rehydration.gate.wait_all()


class _Helper(ThreadPoolExecutor):
    """A one-thread pool that counts what it is handed; `blocked` keeps its thread busy until set."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.handed: list[Future[Any]] = []
        self.blocked = threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        self.handed.append(future)
        return future


@pytest.mark.parametrize("busy", [False, True])
def test_what_is_left_after_the_fetch_is_shared_with_a_helper_that_is_never_waited_for(busy: bool) -> None:
    """Frames still to dequantize once the last chunk is in are taken, a few at a time, by the rehydration's thread
    and a helper. A helper pool whose threads are all busy is not waited for: its task is withdrawn and the
    rehydration's thread does it all (a pool full of rehydrations waiting on helpers would never finish)."""
    gen = torch.Generator().manual_seed(11)
    codec = Codec("int8")
    kvs = [torch.randn(4, 2, 3, 16, 64, generator=gen) for _ in range(9)]
    buf, slots = _landed(codec, kvs, 26_624)
    want = torch.cat([codec.decode(bytes(s), device="cpu").float() for s in slots], dim=3)
    out = torch.full((4, 2, 3, 9 * 16, 64), float("nan"))
    helper = _Helper()
    try:
        if busy:
            helper.submit(helper.blocked.wait)
        decoded: list[float] = []
        rehydration = Rehydration(out, 16, lambda frame, i: codec.open(frame), layerwise=False, landing=buf,
                                  helper=helper, on_decoded=decoded.append)
        for first in range(0, 9, 3):  # queued before the thread runs: nothing is dequantized until the last is in
            rehydration.feed(slots[first:first + 3])
        rehydration.end()
        rehydration.run(lambda n, nbytes: None)
        assert torch.equal(out, want)
        assert len(decoded) == 1 and decoded[0] > 0
        task = helper.handed[-1]
        assert len(helper.handed) == 1 + busy  # asked once
        assert task.done()  # never still writing into the context once the rehydration is over
        if busy:
            assert task.cancelled()  # withdrawn: it could not start
    finally:
        helper.blocked.set()
        helper.shutdown()


def test_fill_puts_a_layer_in_another_buffer_and_leaves_the_context() -> None:
    """`LayerGate.fill` (the hf engine's first step reads it): one layer's cached tokens into a buffer of the
    caller's, the landed runs from the landing and every other token (a frame that came as bytes, a prompt tail
    decoded into the context) as the context holds it; the context's run tokens stay unwritten until `wait`."""
    gen, codec, buf, slots, want, out = _six_landed(7)
    tail = torch.randn(4, 2, 3, 5, 64, generator=gen)
    out[:, :, :, 96:101] = tail  # a tail the lookup decoded into the context itself
    decoded: list[float] = []
    rehydration = Rehydration(out, 16, lambda frame, i: codec.open(frame), layerwise=True, landing=buf,
                              on_decoded=decoded.append)
    rehydration.take([*slots[:2], bytes(slots[2]), *slots[3:]])  # block 2 came as bytes: no run
    rehydration.end()
    rehydration.run(lambda n, nbytes: None)
    gate = rehydration.gate
    assert not gate.fill(0, torch.empty(2, 3, 90, 64))  # shorter than the runs: the context is read instead
    for layer in (0, 1, 2, 3):
        dest = torch.full((2, 3, 101, 64), float("nan"))
        assert gate.fill(layer, dest)
        assert torch.equal(dest[:, :, :96], want[layer]) and torch.equal(dest[:, :, 96:], tail[layer])
    assert len(decoded) == 1  # the hit's dequantization is reported once, by the first pass over every layer
    assert torch.equal(out[:, :, :, 32:48], want[:, :, :, 32:48])  # the frame that is no run: whole, into the context
    assert out[:, :, :, :32].isnan().all() and out[:, :, :, 48:96].isnan().all()  # the runs: not written yet
    gate.wait(1)
    assert torch.equal(out[:2, :, :, :96], want[:2]) and out[2:, :, :, :32].isnan().all()
    assert not gate.fill(1, torch.empty(2, 3, 101, 64))  # in place: the context is read
    gate.wait_all()
    assert torch.equal(out[:, :, :, :96], want) and torch.equal(out[:, :, :, 96:101], tail)
    assert len(decoded) == 1


def _fed(data: bytes, step: int, hold: bool = False) -> tuple[socket.socket, threading.Thread]:
    """One end of a socket pair, fed `data` from the other `step` bytes at a time by a thread; closed after it unless
    `hold` (then kept open for a second, as a server that stalls)."""
    ours, theirs = socket.socketpair()

    def feed() -> None:
        with theirs:
            for at in range(0, len(data), step):
                theirs.sendall(data[at:at + step])
                time.sleep(0.0002)  # the wait is the test: the value arrives in pieces, as over a slow link
            if hold:
                time.sleep(1.0)  # the wait is the test: a server that stalls

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    return ours, thread


def _stream(values: list[bytes]) -> bytes:
    return b"".join(b"$%d\r\n%s\r\n" % (len(v), v) for v in values)


def _targets(arena: bytearray, sizes: list[int], seen: list[bytes]) -> list[wire.Target]:
    """A slot of `arena` per size, 40 bytes apart; every third one (of more than 10 bytes) a Scatter of three pieces,
    out of order, with a gap between them (the first of them reporting each piece to `seen`); the fifth a Scatter
    of 150 pieces a byte apart (more than one readv)."""
    view, at, targets = memoryview(arena), 8, []
    for i, n in enumerate(sizes):
        if i == 4:
            cuts = [n * j // 150 for j in range(151)]
            pieces = [view[at + j + a:at + j + b] for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
            targets.append(wire.Scatter(pieces))
            at += 150
        elif i % 3 == 2 and n > 10:
            third = n // 3
            targets.append(wire.Scatter([view[at + 2 * third + 4:at + n + 4], view[at:at + third],
                                            view[at + third:at + 2 * third]],
                                           (lambda piece: seen.append(bytes(piece))) if i == 2 else None))
        else:
            targets.append(view[at:at + n])
        at += n + 40
    return targets


@pytest.mark.skipif(not wire.NATIVE, reason="cachestore._resp not built")
@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
def test_the_native_reader_lands_what_the_python_one_does_however_the_bytes_arrive(
        step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of values in buffers and across Scatters, broken by replies of every other kind (a null, an error, a
    value of another length, an array, an attribute before a value): the native reader gives what the Python parser
    does, and writes the values where they belong and nothing else."""
    rng = random.Random(step)
    sizes = [3, 0, 70_000, 5, 200_000, 1, 65_534, 12] if step > 1 else [3, 0, 700, 5, 2000, 1, 300, 12]
    values = [rng.randbytes(n) for n in sizes]
    data = (_stream(values[:3]) + b"$-1\r\n-ERR gone\r\n" + _stream([b"other"]) + b"*2\r\n:1\r\n$2\r\nab\r\n"
            + b"|1\r\n+a\r\n:0\r\n" + _stream(values[3:]) + REPLIES)
    size = sum(sizes) + 64 * len(sizes) + 150
    expected = bytearray(b"\xa5" * size)
    for target, value in zip(_targets(expected, sizes, []), values, strict=True):
        if isinstance(target, wire.Scatter):
            target.fill(value)
        else:
            target[:] = value
    import cachestore._resp as resp  # noqa: PLC0415

    natively: list[int] = []

    def counted(*args: Any) -> tuple[int, int, int, int, int]:
        got = resp.receive(*args)
        natively.extend(range(args[7], got[0]))  # the replies it received
        return got

    monkeypatch.setattr(native_wire, "_resp", SimpleNamespace(receive=counted))
    results = []
    for native in (True, False):
        arena, seen = bytearray(b"\xa5" * size), []
        targets = _targets(arena, sizes, seen)
        slots = targets[:3] + [memoryview(bytearray(4))] * 4 + targets[3:]  # 4: "other" (5 bytes) does not fit
        sock, feeder = _fed(data, step)
        reader = wire.make_parser(sock, native=native)
        assert isinstance(reader, native_wire.NativeParser) == native
        try:
            got = reader.replies(len(slots) + 16, slots)
        finally:
            feeder.join()
            sock.close()
        assert reader.buffered == 0
        assert [i for i, g in enumerate(got) if any(g is t for t in targets)] == [0, 1, 2, 7, 8, 9, 10, 11]
        assert arena == expected  # every value where it belongs, nothing written outside
        third = sizes[2] // 3  # each piece of the reporting Scatter reported once, whole, in order
        assert seen == [values[2][:sizes[2] - 2 * third], values[2][sizes[2] - 2 * third:sizes[2] - third],
                        values[2][sizes[2] - third:]]
        assert got[3:7] == [None, got[4], b"other", [1, b"ab"]] and str(got[4]) == "ERR gone"
        results.append([repr(g) for g in got[3:7] + got[12:]])
    assert results[0] == results[1]
    assert natively == [0, 1, 2, 8, 9, 10, 11]  # every value in a buffer or Scatter but the one after an attribute
    assert len(results[0]) == 20 and results[0][-2:] == ["b'xyz'", "None"]


@pytest.mark.skipif(not wire.NATIVE, reason="cachestore._resp not built")
@pytest.mark.parametrize(("data", "error"), [
    (b"$5\r\nhello!!", wire.ProtocolError),  # no CRLF after the value
    (b"$5\r\nhel", redis.ConnectionError),  # closed mid-value
    (b"$5\r\n", redis.ConnectionError),  # closed before the value
    (b"$", redis.ConnectionError),  # closed mid-header
    (b"$99999999999\r\n", wire.ProtocolError),  # longer than Redis allows: the Python parser refuses it
    (b"$5x\r\n", wire.ProtocolError),  # not a length: the Python parser refuses it
    (b"$5" + b"9" * 40, redis.ConnectionError),  # a header with no end, then closed: the Python parser reads on
])
def test_the_native_reader_refuses_a_cut_or_malformed_value(data: bytes, error: type[Exception]) -> None:
    sock, feeder = _fed(data, 3)
    try:
        with pytest.raises(error):
            wire.make_parser(sock).replies(1, [memoryview(bytearray(5))])
    finally:
        feeder.join()
        sock.close()


@pytest.mark.skipif(not wire.NATIVE, reason="cachestore._resp not built")
def test_the_native_reader_keeps_the_socket_timeout() -> None:
    sock, feeder = _fed(b"$10\r\nhello", 100, hold=True)  # half a value, then nothing
    sock.settimeout(0.2)
    started = time.monotonic()
    try:
        with pytest.raises(redis.TimeoutError):
            wire.make_parser(sock).replies(1, [memoryview(bytearray(10))])
        assert 0.15 < time.monotonic() - started < 0.9
    finally:
        feeder.join()
        sock.close()


@pytest.mark.skipif(not wire.NATIVE, reason="cachestore._resp not built")
@pytest.mark.parametrize("native", [True, False])
def test_what_a_scatter_reports_to_raises_out_of_the_reader(native: bool) -> None:
    """`Scatter.filled` is called with the GIL from inside the native reader: what it raises comes out of
    `replies`, after the pieces before it were reported, as from the Python parser."""
    seen: list[bytes] = []

    def filled(piece: memoryview) -> None:
        seen.append(bytes(piece))
        if len(seen) == 2:
            raise ValueError("a bad piece")

    sock, feeder = _fed(_stream([b"abcdefgh"]), 100)
    try:
        scatter = wire.Scatter([memoryview(bytearray(3)), memoryview(bytearray(3)), memoryview(bytearray(2))],
                                  filled)
        with pytest.raises(ValueError, match="a bad piece"):
            wire.make_parser(sock, native=native).replies(1, [scatter])
        assert seen == [b"abc", b"def"]
    finally:
        feeder.join()
        sock.close()


def test_a_large_scatter_that_reports_its_pieces_keeps_the_python_parser() -> None:
    """Up to NATIVE_REPORTED_BYTES a reporting Scatter is landed natively (pieces reported from C); above it, the
    Python parser takes it (f16 rows were no faster natively); a silent one is landed natively at any
    size."""
    big = [memoryview(bytearray(native_wire.NATIVE_REPORTED_BYTES // 2 + 1)) for _ in range(2)]
    small = [memoryview(bytearray(1000)) for _ in range(2)]
    assert native_wire.native_pieces(wire.Scatter(big, lambda piece: None)) is None
    assert native_wire.native_pieces(wire.Scatter(big)) is not None
    assert native_wire.native_pieces(wire.Scatter(small, lambda piece: None)) is not None
