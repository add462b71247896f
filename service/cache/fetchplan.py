"""Fetch or recompute: a pod's running estimates of its read bandwidth from Redis and of its prefill rate, and how many
of a lookup's blocks are worth reading.

A hit pays only while reading a block takes less time than prefilling its tokens again. Where prefill is fast (a GPU, a
small model) and the link slow, fetching a long prefix can take longer than recomputing it. Before each lookup the pod
compares, per block,

    fetch_s     = block_bytes / link_bytes_s       (the best of its last reads, end to end: round trips,
                                                    verification and all; a slow read is more often this pod's
                                                    CPU being busy, which slows a prefill too, than the link)
    recompute_s = block_tokens / prefill_tokens_s  (a running mean of the pod's own prefills)

and reads every block (`fetch`) unless fetching is clearly the dearer (RECOMPUTE_MARGIN: near a tie a hit still
leaves the cores to other requests), only the prefix that fits the Redis time budget (`shortened`) when the whole
prompt would not arrive in it, and none (`recompute`) when prefilling is clearly the cheaper. Both sides grow
with the block count at the same slope, so the answer is all or none of the prompt's remote blocks (blocks held in the
pod's local tier cost nothing and are always read). Until the prefill rate and MIN_LINK_SAMPLES reads are measured,
and once in a while after deciding to recompute on a measured link (`reprobe_s`: the link may have recovered), the
pod reads (`probe`).

A read's time is its round trips plus its bytes over the link, and the estimate is one rate: a small read (the shared
system prompt's block or two, which is what a fresh pod's first hits often are) measures mostly round trips, and its
rate extrapolated to a long prefix makes that prefix look far dearer than it is. So a plan recomputes only on
evidence of its own size: MIN_LINK_SAMPLES reads of at least SIMILAR_SHARE of the bytes it would read; with fewer, a
plan the estimate would recompute reads instead (`probe`), and measures the link at that size. A fast small read
still counts for fetching (its rate is a lower bound on the link's).

`fetch_policy="always"` reads every block as before; a configured `link_bytes_s` or `prefill_tokens_s` replaces the
measurement (operators who know their link; tests).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

POLICIES = ("auto", "always")
DECISIONS = ("fetch", "shortened", "recompute", "probe")
SMOOTHING = 0.3  # weight of the newest sample in each running estimate
BUDGET_SHARE = 0.8  # a shortened read is planned to end within this share of the Redis time budget
REPROBE_S = 30.0  # a measured link found too slow is read again after this long
LINK_WINDOW = 8  # the link's estimate is the best of this many recent reads
MIN_LINK_SAMPLES = 3  # reads measured before a plan may recompute (a pod's first read also opens its connection)
RECOMPUTE_MARGIN = 1.5  # recompute only when reading a block is estimated this many times slower than prefilling it
SIMILAR_SHARE = 0.5  # a read of at least this share of a plan's bytes tells how long the planned read takes


@dataclass(frozen=True)
class Plan:
    """How many of a lookup's blocks to read, and why (`decision`, one of DECISIONS)."""

    blocks: int
    decision: str
    fetch_s: float | None = None  # the estimated time to read the remote blocks asked about; None: not known
    recompute_s: float | None = None  # the estimated time to prefill them instead


class _Running:
    """An exponentially weighted mean of positive samples (None until the first)."""

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else SMOOTHING * sample + (1 - SMOOTHING) * self.value


class FetchPlanner:
    """One per pod; thread-safe (lookups on the event loop, prefills observed from there too)."""

    def __init__(
        self, policy: str, block_tokens: int, budget_s: float, *, link_bytes_s: float = 0.0,
        prefill_tokens_s: float = 0.0, reprobe_s: float = REPROBE_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`link_bytes_s`, `prefill_tokens_s`: fixed estimates (0: measured). `budget_s`: the most a lookup waits on
        Redis (a read planned to take longer is shortened to fit)."""
        if policy not in POLICIES:
            raise ValueError(f"fetch policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if link_bytes_s < 0 or prefill_tokens_s < 0 or budget_s <= 0 or block_tokens < 1:
            raise ValueError("rates must be >= 0 (0: measured), the budget and block_tokens positive")
        self.policy = policy
        self.block_tokens = block_tokens
        self.budget_s = budget_s
        self.reprobe_s = reprobe_s
        self._clock = clock
        self._link_fixed = link_bytes_s or None
        self._prefill_fixed = prefill_tokens_s or None
        self._link: deque[tuple[float, int]] = deque(maxlen=LINK_WINDOW)  # (bytes/s, bytes) of recent reads
        self._prefill = _Running()
        self._block_bytes = _Running()
        self._link_seen = -float("inf")  # when the link was last measured
        self._lock = threading.Lock()

    @property
    def link_bytes_s(self) -> float | None:
        """The read bandwidth from Redis (configured, or the best recent read), None while nothing is measured."""
        return self._link_fixed or (max(rate for rate, _ in self._link) if self._link else None)

    def _planned_link(self) -> float | None:
        """The bandwidth plans use: None until MIN_LINK_SAMPLES reads are measured (unless configured)."""
        return self._link_fixed or (max(rate for rate, _ in self._link) if len(self._link) >= MIN_LINK_SAMPLES
                                    else None)

    def _measured_at(self, nbytes: float) -> bool:
        """Whether the link's estimate may stop a read of `nbytes`: configured, or MIN_LINK_SAMPLES recent reads
        of at least SIMILAR_SHARE of it measured."""
        if self._link_fixed is not None:
            return True
        return sum(1 for _, size in self._link if size >= SIMILAR_SHARE * nbytes) >= MIN_LINK_SAMPLES

    @property
    def prefill_tokens_s(self) -> float | None:
        """The prefill rate the plans use (configured or measured), None while unknown."""
        return self._prefill_fixed or self._prefill.value

    def observe_fetch(self, nbytes: int, blocks: int, seconds: float) -> None:
        """A read of `blocks` remote blocks, `nbytes` in all, took `seconds` (from request to verified)."""
        if nbytes <= 0 or blocks <= 0 or seconds <= 0:
            return
        with self._lock:
            self._link.append((nbytes / seconds, nbytes))
            self._block_bytes.add(nbytes / blocks)
            self._link_seen = self._clock()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine prefilled `tokens` in `seconds` (to its first token); fewer than a block tells too little."""
        if tokens < self.block_tokens or seconds <= 0:
            return
        with self._lock:
            self._prefill.add(tokens / seconds)

    def plan(self, remote_blocks: int, block_bytes: float | None = None) -> Plan:
        """What to read of `remote_blocks` blocks Redis may hold (after those held locally). `block_bytes`: a block's
        size when the codec fixes it, else the sizes read so far are used."""
        if self.policy == "always" or remote_blocks <= 0:
            return Plan(remote_blocks, "fetch")
        with self._lock:
            size = block_bytes or self._block_bytes.value
            link, prefill = self._planned_link(), self.prefill_tokens_s
            stale = self._link_fixed is None and self._clock() - self._link_seen >= self.reprobe_s
            measured = size is not None and self._measured_at(remote_blocks * size)
        if size is None or link is None or prefill is None:
            return Plan(remote_blocks, "probe")
        per_fetch, per_compute = size / link, self.block_tokens / prefill
        fetch_s, recompute_s = remote_blocks * per_fetch, remote_blocks * per_compute
        if per_fetch > RECOMPUTE_MARGIN * per_compute:
            if stale or not measured:  # the link measured long ago, or only on reads much smaller than this one
                return Plan(remote_blocks, "probe", fetch_s, recompute_s)
            return Plan(0, "recompute", fetch_s, recompute_s)
        fits = int(BUDGET_SHARE * self.budget_s / per_fetch)
        if fits >= remote_blocks:
            return Plan(remote_blocks, "fetch", fetch_s, recompute_s)
        if not measured:
            return Plan(remote_blocks, "probe", fetch_s, recompute_s)
        if fits == 0:
            return Plan(0, "recompute", fetch_s, recompute_s)
        return Plan(fits, "shortened", fetch_s, recompute_s)
