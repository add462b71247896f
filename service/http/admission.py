"""Admission: at most `max_queue` requests admitted at once; one more is refused with a 503 and Retry-After."""

from __future__ import annotations

from service.http.errors import overloaded
from service.runtime.metrics import PodMetrics


class Ticket:
    """One admitted request's place: `release` gives it back once, however often it is called (a failed lookup, a
    stream's end, a client that left)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            admission, self._admission = self._admission, None
            admission.release()


class Admission:
    """The pod's bound on requests in flight (event loop only); each `admit` is paired with one `release`."""

    def __init__(self, max_queue: int, metrics: PodMetrics) -> None:
        self.max_queue = max_queue
        self.metrics = metrics
        self.admitted = 0

    def admit(self) -> Ticket:
        """Admit a request, its ticket to release, or refuse it with 503 when `max_queue` are already admitted."""
        if self.admitted >= self.max_queue:
            self.metrics.rejected.inc()
            raise overloaded(f"pod is busy ({self.admitted} requests admitted); retry shortly")
        self.admitted += 1
        self.metrics.inflight.set(self.admitted)
        return Ticket(self)

    def release(self) -> None:
        self.admitted -= 1
        self.metrics.inflight.set(self.admitted)
