"""Hostile frames: a crafted-header corpus and random well-checksummed headers over lying payloads, decoded with
the default limits (as a pod does) in a child process that reports each decode's peak resident memory and CPU
time (tests/decodeprobe.py): only CodecError, bounded memory and work.

KVSTASH_FUZZ_EXAMPLES sets the hypothesis examples (default 300; `make test-faults` runs thousands).
"""

from __future__ import annotations

import itertools
import os
import struct
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachestore.codec import Codec
from cachestore.codec.frame import HEADER, HEADER_SIZE, MAGIC, checksum
from tests.decodeprobe import DecodeProbe, Outcome

EXAMPLES = int(os.environ.get("KVSTASH_FUZZ_EXAMPLES", "300"))
MAX_PEAK_BYTES = 4 << 20  # a hostile frame of a few kB may not make the decoder's process grow more than this
MAX_CPU_S = 0.5  # nor use more CPU than this (each is rejected in microseconds; CPU time ignores machine load)
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
    # format 3: a layer table after the header (int4, transform bit 4), lying about its layers or bits
    table = dict(version=3, mode=4, group=4, reserved=4)
    yield "table-truncated", frame(b"\x84", layers=2, **table)
    yield "table-65535-layers", frame(small, layers=(1 << 16) - 1, **table)
    yield "table-65535-layers-int8", frame(b"\x88" * ((1 << 16) - 1), layers=(1 << 16) - 1, tokens=1, **table)
    yield "table-bad-bits", frame(b"\x33\x84" + small, **table)
    yield "table-in-version-2", frame(b"\x84\x84" + small, **{**table, "version": 2})
    yield "bad-checksum", frame(small, fix_checksum=False)[:-1] + b"\x01"
    yield "header-only", frame(b"")
    yield "short", frame(small)[:HEADER_SIZE - 1]
    # a lz4 / zstd bomb: tiny payload claiming a huge decompressed size within the element limit
    yield "zstd-bomb", frame(bytes.fromhex("28b52ffd") + b"\x00" * 60, comp=2, tokens=1 << 20, raw_len=1 << 30)
    yield "lz4-bomb", frame(b"\xff" * 64, comp=1, tokens=1 << 20, raw_len=1 << 30)


CORPUS = list(corpus())


@pytest.fixture(scope="module")
def probe() -> Iterator[DecodeProbe]:
    with DecodeProbe() as p:
        yield p


def _within_bounds(outcome: Outcome, name: str, max_peak: int = MAX_PEAK_BYTES) -> None:
    assert outcome.status in ("CodecError", "decoded"), f"{name}: raised {outcome.status}"
    assert outcome.peak_bytes < max_peak, f"{name}: the decoder's process grew by {outcome.peak_bytes} bytes"
    assert outcome.cpu_s < MAX_CPU_S, f"{name}: {outcome.cpu_s:.3f} s of CPU"


@pytest.mark.parametrize(("name", "data"), CORPUS, ids=[n for n, _ in CORPUS])
def test_crafted_header_corpus(probe: DecodeProbe, name: str, data: bytes) -> None:
    outcome = probe.decode(data)
    _within_bounds(outcome, name)
    assert outcome.status == "CodecError", f"{name}: a crafted frame decoded"


RANDOM_SEEN: Counter[str] = Counter()  # figures of the random property: outcomes, worst peak and CPU time
RANDOM_MAX = {"peak_bytes": 0.0, "cpu_s": 0.0}
FIELD = st.one_of(st.integers(0, 8), st.sampled_from([1 << 15, (1 << 16) - 1, 1 << 16, 1 << 24, U32]))


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(codes=st.tuples(*[st.integers(0, 9)] * 4, st.integers(0, 3), st.integers(0, 1), st.integers(0, 1100)),
       dims=st.tuples(FIELD, FIELD, FIELD, FIELD),
       raw_len=st.one_of(st.integers(0, 4096), st.sampled_from([1 << 31, 1 << 40, U64])),
       payload=st.binary(max_size=2048), lie=st.sampled_from([None, 0, 1 << 31, U64]))
def test_random_checksummed_headers_stay_bounded(probe: DecodeProbe, figures: dict[str, object],
                                                 codes: tuple[int, ...], dims: tuple[int, ...], raw_len: int,
                                                 payload: bytes, lie: int | None) -> None:
    version, mode, comp, dtype, flags, reserved, group = codes
    fields = dict(version=version, mode=mode, comp=comp, dtype=dtype, flags=flags, reserved=reserved,
                  group=group, layers=dims[0], heads=dims[1], tokens=dims[2], dim=dims[3], raw_len=raw_len)
    if lie is not None:
        fields["payload_len"] = lie
    # a decode that succeeds is fine if it stays bounded
    extra = 8 * (len(payload) + raw_len) if raw_len < 1 << 16 else 0
    outcome = probe.decode(frame(payload, **fields))
    _within_bounds(outcome, repr(fields), MAX_PEAK_BYTES + extra)
    RANDOM_SEEN[outcome.status] += 1
    RANDOM_MAX["peak_bytes"] = max(RANDOM_MAX["peak_bytes"], outcome.peak_bytes)
    RANDOM_MAX["cpu_s"] = max(RANDOM_MAX["cpu_s"], outcome.cpu_s)
    figures.update(outcomes=dict(RANDOM_SEEN), max_peak_bytes=int(RANDOM_MAX["peak_bytes"]),
                   max_cpu_s=round(RANDOM_MAX["cpu_s"], 6))


def test_a_valid_frame_still_decodes_under_the_same_bounds(probe: DecodeProbe) -> None:
    outcome = probe.decode(Codec("exact+none").encode(torch.randn(2, 2, 2, 4, 8)))
    _within_bounds(outcome, "valid")
    assert outcome.status == "decoded"
    assert len(CORPUS) > 60 and len(set(itertools.chain(n for n, _ in CORPUS))) == len(CORPUS)


def test_the_probe_sees_torch_allocations(probe: DecodeProbe) -> None:
    """The measure must see what tracemalloc missed: a valid 32 MiB frame makes the child grow by about that."""
    big = Codec("exact+none").encode(torch.ones(4, 2, 8, 512, 256))  # 32 MiB of fp32 once decoded
    outcome = probe.decode(big)
    assert outcome.status == "decoded" and outcome.peak_bytes > 24 << 20, outcome
