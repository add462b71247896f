"""Hostile frames: a crafted-header corpus and random well-checksummed headers over lying payloads, decoded with
the default limits (as a pod does) under tracemalloc and a deadline: only CodecError, bounded memory and time.

KVSTASH_FUZZ_EXAMPLES sets the hypothesis examples (default 300; `make test-faults` runs thousands).
"""

from __future__ import annotations

import itertools
import os
import struct
import time
import tracemalloc
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachestore.codec import Codec
from cachestore.errors import CodecError
from cachestore.frame import HEADER, HEADER_SIZE, MAGIC, checksum

EXAMPLES = int(os.environ.get("KVSTASH_FUZZ_EXAMPLES", "300"))
DECODER = Codec()
MAX_PEAK_BYTES = 4 << 20  # a hostile frame of a few kB may not make the decoder allocate more than this
MAX_SECONDS = 2.0  # nor keep it busy longer than this (a hang detector; loaded 2-core CI machines are slow)
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
GOOD = dict(version=1, mode=1, comp=0, dtype=1, flags=0, reserved=0, group=0, layers=2, heads=2, tokens=4,
            dim=8, raw_len=2 * 2 * 2 * 4 * 8 * 4, payload_len=0)


def frame(payload: bytes = b"", fix_checksum: bool = True, **fields: int) -> bytes:
    f = {**GOOD, "payload_len": len(payload), **fields}
    header = HEADER.pack(MAGIC, f["version"], f["mode"], f["comp"], f["dtype"], f["flags"], f["reserved"],
                         f["group"], f["layers"], f["heads"], f["tokens"], f["dim"], f["raw_len"],
                         f["payload_len"], 0)
    if not fix_checksum:
        return header + payload
    digest = checksum(header, payload)
    return header[:HEADER_SIZE - 8] + struct.pack("<Q", digest) + payload


def corpus() -> Iterator[tuple[str, bytes]]:
    """Headers an attacker who can write to Redis would try, each with a correct checksum."""
    small = b"\x00" * 512
    for version in (0, 2, 7, 255):
        yield f"version-{version}", frame(small, version=version)
    for mode, comp, dtype in ((0, 0, 1), (7, 0, 1), (255, 0, 1), (1, 3, 1), (1, 255, 1), (1, 0, 0), (1, 0, 9)):
        yield f"codes-{mode}-{comp}-{dtype}", frame(small, mode=mode, comp=comp, dtype=dtype)
    huge = (0, 1, 1 << 15, (1 << 16) - 1, 1 << 16, 1 << 24, U32)
    for name in ("layers", "heads", "tokens", "dim"):
        for value in huge:
            yield f"{name}-{value}", frame(small, **{name: value})
    yield "all-max-below-limits", frame(small, layers=(1 << 16) - 1, heads=(1 << 16) - 1, tokens=(1 << 24) - 1,
                                        dim=(1 << 16) - 1)
    for raw_len in (0, 1, 511, 513, 1 << 31, 1 << 40, U64):
        yield f"raw_len-{raw_len}", frame(small, raw_len=raw_len)
        yield f"raw_len-lz4-{raw_len}", frame(small, comp=1, raw_len=raw_len)
        yield f"raw_len-zstd-{raw_len}", frame(small, comp=2, raw_len=raw_len)
    for payload_len in (0, 1, 511, 513, 1 << 31, 1 << 63, U64):  # lying about the stored length
        yield f"payload_len-{payload_len}", frame(small, payload_len=payload_len)
    for group in (0, 1, 3, 5, 1025, 65535):
        yield f"int4-group-{group}", frame(small, mode=4, group=group)
    yield "flags", frame(small, flags=0xFE)
    yield "reserved", frame(small, reserved=1)
    yield "shuffle-on-int8", frame(small, mode=3, flags=1)
    yield "bad-checksum", frame(small, fix_checksum=False)[:-1] + b"\x01"
    yield "header-only", frame(b"")
    yield "short", frame(small)[:HEADER_SIZE - 1]
    # a lz4 / zstd bomb: tiny payload claiming a huge decompressed size within the element limit
    yield "zstd-bomb", frame(bytes.fromhex("28b52ffd") + b"\x00" * 60, comp=2, tokens=1 << 20, raw_len=1 << 30)
    yield "lz4-bomb", frame(b"\xff" * 64, comp=1, tokens=1 << 20, raw_len=1 << 30)


CORPUS = list(corpus())


def _bounded_decode(data: bytes) -> tuple[bool, int, float]:
    """Decode `data` as a pod does; (raised CodecError?, peak bytes allocated, seconds)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = DECODER.decode(data)
        assert isinstance(out, torch.Tensor) and out.dim() == 5
        failed = False
    except CodecError:
        failed = True
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return failed, peak, elapsed


@pytest.mark.parametrize(("name", "data"), CORPUS, ids=[n for n, _ in CORPUS])
def test_crafted_header_corpus(name: str, data: bytes) -> None:
    failed, peak, elapsed = _bounded_decode(data)
    assert failed, f"{name}: a crafted frame decoded"
    assert peak < MAX_PEAK_BYTES, f"{name}: peak {peak} bytes"
    assert elapsed < MAX_SECONDS, f"{name}: {elapsed:.3f} s"


FIELD = st.one_of(st.integers(0, 8), st.sampled_from([1 << 15, (1 << 16) - 1, 1 << 16, 1 << 24, U32]))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(codes=st.tuples(*[st.integers(0, 9)] * 4, st.integers(0, 3), st.integers(0, 1), st.integers(0, 1100)),
       dims=st.tuples(FIELD, FIELD, FIELD, FIELD),
       raw_len=st.one_of(st.integers(0, 4096), st.sampled_from([1 << 31, 1 << 40, U64])),
       payload=st.binary(max_size=2048), lie=st.sampled_from([None, 0, 1 << 31, U64]))
def test_random_checksummed_headers_stay_bounded(codes: tuple[int, ...], dims: tuple[int, ...], raw_len: int,
                                                 payload: bytes, lie: int | None) -> None:
    version, mode, comp, dtype, flags, reserved, group = codes
    fields = dict(version=version, mode=mode, comp=comp, dtype=dtype, flags=flags, reserved=reserved,
                  group=group, layers=dims[0], heads=dims[1], tokens=dims[2], dim=dims[3], raw_len=raw_len)
    if lie is not None:
        fields["payload_len"] = lie
    data = frame(payload, **fields)
    _, peak, elapsed = _bounded_decode(data)  # a decode that succeeds is fine if it stays bounded
    assert peak < MAX_PEAK_BYTES + 8 * (len(payload) + raw_len if raw_len < 1 << 16 else 0)
    assert elapsed < MAX_SECONDS


def test_a_valid_frame_still_decodes_under_the_same_bounds() -> None:
    kv = torch.randn(2, 2, 2, 4, 8)
    failed, peak, elapsed = _bounded_decode(Codec("exact+none").encode(kv))
    assert not failed and peak < MAX_PEAK_BYTES and elapsed < MAX_SECONDS
    assert len(CORPUS) > 60 and len(set(itertools.chain(n for n, _ in CORPUS))) == len(CORPUS)
