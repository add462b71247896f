"""The events of `kvstash bench fleet --churn`: what happens to a fleet's pods while its load runs, and when.

    rolling     each pod in turn is replaced, the next `--churn-gap` seconds after (minReadySeconds). `--rollout
                surge` (default, what ops/k8s's Deployments do: maxSurge 1, maxUnavailable 0): a new pod is started
                and, once ready, routed to; the old one is taken off the balancer, then gets SIGTERM and `--grace-s`
                to drain and exit (then SIGKILL, as a kubelet's terminationGracePeriodSeconds ends). `in-place`
                (maxUnavailable 1, the fleet never larger): the pod gets SIGTERM first and is started again on its
                port once gone.
    scale-out   a pod is added; once ready, nginx is reloaded with it (as a Service adds a ready endpoint)
    kill        the pod that has answered the most turns so far gets SIGKILL (an OOM kill, a lost node) and is
                started again on its port at once (its ReplicaSet replacing it)

An event begins at its `--churn-at` second of the run (or when the event before it ends, if later) and ends when
its last pod is ready again; the report keeps both moments, so turns can be told apart by when they arrived.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

EVENTS = ("rolling", "scale-out", "kill")
ROLLOUTS = ("surge", "in-place")


@dataclass(frozen=True)
class ChurnEvent:
    kind: str
    at_s: float


def plan(events: str, at: str, duration_s: float, pods: int, gap_s: float) -> list[ChurnEvent]:
    """The events of `--churn` at the seconds of `--churn-at` (default: spread over the run, the first a third of the
    way in); ValueError, in one line, for an unknown event or a schedule that does not fit in the run's arrivals."""
    kinds = [e.strip() for e in events.split(",") if e.strip()]
    unknown = [k for k in kinds if k not in EVENTS]
    if not kinds or unknown:
        named = ", ".join(unknown) or repr(events)
        raise ValueError(f"--churn takes {', '.join(EVENTS)} (comma-separated), not {named}")
    if at.strip():
        try:
            times = [float(x) for x in at.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--churn-at takes seconds into the run, comma-separated, not {at!r}") from None
        if len(times) != len(kinds):
            raise ValueError(f"--churn-at names {len(times)} moment(s) for {len(kinds)} event(s) of --churn")
    else:
        times = [duration_s * (i + 1) / (len(kinds) + 2) for i in range(len(kinds))]
    if any(not math.isfinite(t) or t <= 0 for t in times) or times != sorted(times):
        raise ValueError("--churn-at takes positive seconds in the order of the events")
    if gap_s < 0 or not math.isfinite(gap_s):
        raise ValueError("--churn-gap takes seconds, 0 or more")
    for kind, t in zip(kinds, times, strict=True):
        # the least an event takes: a rolling restart waits --churn-gap between its pods (each restart takes longer)
        last = t + (gap_s * (pods - 1) if kind == "rolling" else 0.0)
        if last >= duration_s:
            steps = f" (its last pod {gap_s * (pods - 1):g} s later at the least)" if last > t else ""
            raise ValueError(f"--churn {kind} at {t:g} s{steps} is not within the run: arrivals last "
                             f"--duration-s {duration_s:g} s")
    return [ChurnEvent(k, t) for k, t in zip(kinds, times, strict=True)]


class ChurnRunner:
    """Plays a fleet's events on a thread, against the run's clock; `row_done` is fed every answered turn (the kill
    chooses the busiest pod by them)."""

    def __init__(self, events: list[ChurnEvent], fleet: Any, *, grace_s: float, gap_s: float,
                 rollout: str = "surge") -> None:
        if rollout not in ROLLOUTS:
            raise ValueError(f"a rollout is one of {', '.join(ROLLOUTS)}, not {rollout!r}")
        self._events, self._fleet, self._grace_s, self._gap_s = events, fleet, grace_s, gap_s
        self._rollout = rollout
        self._started = 0.0
        self._served: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.report: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._run, name="kvstash-bench-churn", daemon=True)

    def start(self, started: float) -> ChurnRunner:
        self._started = started
        self._thread.start()
        return self

    def row_done(self, row: dict[str, Any]) -> None:
        if row.get("status") == 200:
            with self._lock:
                self._served[str(row.get("upstream") or row.get("pod"))] += 1

    def finish(self) -> list[dict[str, Any]]:
        """The run is over: an event not yet begun never happens (it is reported as not done); one under way is
        waited for."""
        self._stop.set()
        self._thread.join()
        return self.report

    def _now(self) -> float:
        return time.monotonic() - self._started

    def _run(self) -> None:
        for event in self._events:
            record: dict[str, Any] = {"event": event.kind, "at_s": event.at_s, "done": False, "steps": []}
            self.report.append(record)
            if self._stop.wait(max(0.0, event.at_s - self._now())):
                continue
            record["began_s"] = self._now()
            try:
                getattr(self, "_" + event.kind.replace("-", "_"))(record)
            except Exception as exc:  # noqa: BLE001 - reported; the run goes on with the pods that are left
                record["error"] = f"{type(exc).__name__}: {exc}"[:300]
            else:
                record["done"] = True
            record["ended_s"] = self._now()

    def _restart(self, pod: Any, record: dict[str, Any], how: str) -> None:
        step: dict[str, Any] = {"pod": pod.name, "signal": how, "stopped_s": self._now()}
        record["steps"].append(step)
        if how == "SIGTERM":
            step.update(pod.terminate(self._grace_s))
        else:
            pod.kill()  # no drain, no goodbye: whatever it held is lost
            step.update(exit_s=0.0, killed=True)
        step["exited_s"] = self._now()
        if pod.log_path is not None:
            pod.log_path.unlink(missing_ok=True)
        pod.start()  # the same port: the balancer's upstream list does not change
        pod.wait_ready()
        step["ready_s"] = self._now()

    def _rolling(self, record: dict[str, Any]) -> None:
        record["rollout"] = self._rollout
        for i, pod in enumerate(list(self._fleet.live)):
            if i and self._stop.wait(self._gap_s):
                record["cut_short"] = True  # the run ended first: the pods after this one were not restarted
                return
            if self._rollout == "surge":
                self._replace(pod, record)
            else:
                self._restart(pod, record, "SIGTERM")

    def _replace(self, old: Any, record: dict[str, Any]) -> None:
        """A new pod first, routed once ready; then the old one off the balancer, SIGTERMed and drained."""
        step: dict[str, Any] = {"pod": old.name, "signal": "SIGTERM", "surge_s": self._now()}
        record["steps"].append(step)
        new = self._fleet.add_pod()
        step.update(replaced_by=new.name, ready_s=self._now())
        self._fleet.retire(old)  # nginx reloaded without it: its open connections finish, no new ones come
        step["stopped_s"] = self._now()
        step.update(old.terminate(self._grace_s))
        step["exited_s"] = self._now()

    def _kill(self, record: dict[str, Any]) -> None:
        by_port = {f"127.0.0.1:{p.port}": p for p in self._fleet.live}
        by_name = {p.name: p for p in self._fleet.live}
        with self._lock:
            busiest = [key for key, _ in self._served.most_common() if key in by_port or key in by_name]
        pod = (by_port.get(busiest[0]) or by_name[busiest[0]]) if busiest else self._fleet.live[0]
        self._restart(pod, record, "SIGKILL")

    def _scale_out(self, record: dict[str, Any]) -> None:
        step: dict[str, Any] = {"started_s": self._now()}
        record["steps"].append(step)
        pod = self._fleet.add_pod()
        step.update(pod=pod.name, ready_s=self._now())
