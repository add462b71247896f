"""Eviction policies of the byte budget: the score each entry gets in its shard's LRU ZSET (the lowest leaves
first), and the chain facts (depth, parent) that let a policy take a conversation from its end.

A score is `(ms - EPOCH_MS) * RANKS + rank`: time first, then a rank in 0..RANKS-1 among entries of the same time.
One ZSET order per shard, merged over the shards by cachestore.budget.evict, so every policy is the same O(log n)
ZADD/ZRANGE per block as the per-block LRU it replaces.

- `lru`: each block by its own last access (rank 0). A lookup touches a whole prefix at once and a write scores
  its new blocks later than the prefix before them, so under pressure a chain loses its head first and every block
  after it is dead weight (held, unreachable).
- `chain`: the LRU of chain ends. A chained read ranks a block by its depth (deeper lower, time truncated to
  TICK_MS so the chunks of one lookup share it), and a write scores each new block by its write time and depth,
  but never above just below its parent's
  current score: a block always scores below its parent, so eviction takes every chain from its end, a prefix
  many chains share (touched by each) outlives them, and no eviction leaves a block unreachable. Where writers and
  readers on other pods interleave with an eviction (a block written on a parent between the evictor's PEEK and
  its EVICT, a reader's touch between two shards' EVICTs), the evictor reaps what it left dead (budget.reap: the
  index's `kids` of each block it took, in every shard) and a writer whose parent left the index while it wrote
  removes its blocks again, so no block outlives its parent.
- `chain-freq`: `chain`, each doubling of an entry's hits worth FREQ_MS of recency (hits counted by reads).
- `chain-probation`: `chain` with S3-FIFO-style admission: a block written but not read since counts
  PROBATION_MS older, so one-off prompts leave before blocks that were reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

EPOCH_MS = 1_700_000_000_000  # 2023-11-14: scores stay exact integers (< 2^53) for 69 years after it
RANKS = 4096  # ranks within one time; a chain deeper than RANKS - 1 blocks shares the lowest rank
TICK_MS = 1000  # a chained read's time is truncated to this: the chunks of one lookup score as one
FREQ_MS = 60_000
PROBATION_MS = 120_000


@dataclass(frozen=True)
class Policy:
    """How scores are made: by depth and inherited from the parent (`chained`), lifted by hits, or held back
    until a first read."""

    name: str
    chained: bool
    freq_ms: int = 0
    probation_ms: int = 0

    @property
    def freq_unit(self) -> int:
        """Score units a doubling of an entry's hits is worth (0: hits not counted)."""
        return self.freq_ms * RANKS

    def read_base(self, now_ms: int) -> int:
        """The score of a read at `now_ms` before its rank."""
        ms = now_ms - now_ms % TICK_MS if self.chained else now_ms
        return (ms - EPOCH_MS) * RANKS

    def write_scores(self, now_ms: int, first_depth: int, count: int, parent_score: int | None) -> list[int]:
        """Scores of `count` new blocks of one chain from depth `first_depth`, whose parent scores `parent_score`
        (None: no parent, or none indexed)."""
        if not self.chained:
            return [(now_ms - EPOCH_MS) * RANKS] * count
        base = (now_ms - EPOCH_MS - self.probation_ms) * RANKS  # to the ms: writes are one round trip
        scores = [base + rank(first_depth + i) for i in range(count)]
        if parent_score is not None:
            scores = [min(s, parent_score - 1 - i) for i, s in enumerate(scores)]
        return scores


def rank(depth: int) -> int:
    return RANKS - 1 - min(depth, RANKS - 1)


def score_ms(score: float) -> float:
    """The time (ms since the Unix epoch) a score stands for, its rank and lifts aside."""
    return score // RANKS + EPOCH_MS


def now_ms() -> int:
    return int(time.time() * 1000)


POLICIES = {p.name: p for p in (
    Policy("lru", chained=False),
    Policy("chain", chained=True),
    Policy("chain-freq", chained=True, freq_ms=FREQ_MS),
    Policy("chain-probation", chained=True, probation_ms=PROBATION_MS),
)}
DEFAULT_POLICY = "chain"


def chain_facts(depth: int, parent_hex: str) -> str:
    """What the index keeps of a block's place in its chain: "depth" or "depth:parent hash hex"."""
    return f"{depth}:{parent_hex}" if parent_hex else str(depth)


def parse_facts(raw: str) -> tuple[int, str]:
    """(depth, parent hash hex or "") from `chain_facts`' text; (0, "") for what it cannot read."""
    depth, _, parent = raw.partition(":")
    return (int(depth), parent) if depth.isdigit() else (0, "")
