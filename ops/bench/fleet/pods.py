"""The pods of one `kvstash bench fleet` fleet behind nginx, by kind, and what the churn events do to them (a pod
added, and the balancer told).

In-process engines (hf, llamacpp): `kvstash` pods share KV through Redis behind a round robin; `off` pods cache
nothing; `sticky` pods keep KV in their own memory (`--memory-kv-bytes`) behind nginx's consistent hash on the
user's session. The sidecar (`llama-server`): `kvstash` and `kvstash-ram` are `kvstash sidecar --spawn` pods, their
llama-server's own RAM prompt cache off (`--cache-ram 0`, the sidecar's default) or on at llama-server's default;
`off` is the sidecar with no cache; `sticky` is stock llama-server with its RAM cache behind the consistent hash.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

FLEETS = ("kvstash", "off", "sticky")
SIDECAR_FLEETS = ("kvstash", "kvstash-ram", "off", "sticky")
LABELS = {"kvstash": "kvstash", "off": "no cache", "sticky": "sticky sessions"}
SIDECAR_LABELS = {"kvstash": "kvstash sidecar", "kvstash-ram": "kvstash sidecar + llama-server cache-ram",
                  "off": "no cache", "sticky": "llama-server cache-ram, sticky"}
STICKY_HEADER = "X-Session-Id"  # what nginx hashes in a sticky fleet (the workload sends it there)
CACHE_RAM_MIB = 8192  # llama-server's default --cache-ram (`llama-server --help`), named for the sidecar's -- args
SIDECAR_METRIC = re.compile(r'^kvstash_sidecar_(?:events_total\{event="(?P<event>\w+)"\}|restored_tokens_total) '
                            r'(?P<value>[0-9.eE+-]+)$', re.M)
CTX_PER_SLOT = 4096  # a llama-server slot's context in the sidecar fleets: the workload's longest chats fit


def fleets_of(engine: str) -> tuple[str, ...]:
    return SIDECAR_FLEETS if engine == "llama-server" else FLEETS


def label(kind: str, engine: str) -> str:
    return (SIDECAR_LABELS if engine == "llama-server" else LABELS)[kind]


class FleetPods:
    """One fleet's pods behind nginx, started on entry and stopped on exit; `add_pod` grows it (scale-out).
    `args`: the bench's (engine, model, codec, parallel, threads, flash_attn, users, pods)."""

    def __init__(self, args: argparse.Namespace, redis_url: str, kind: str, namespace: str, budget_mb: int) -> None:
        self.args, self.redis_url, self.kind, self.namespace = args, redis_url, kind, namespace
        self.budget_mb = budget_mb
        self.pods: list[Any] = []  # every pod the fleet has had, in the order they started
        self.retired: set[str] = set()  # names of those a surge rollout replaced (off the balancer, stopped)
        self.balancer: Any = None

    @property
    def live(self) -> list[Any]:
        """The pods the balancer routes to."""
        return [p for p in self.pods if p.name not in self.retired]

    @property
    def url(self) -> str:
        return str(self.balancer.url)

    def names_by_port(self) -> dict[str, str]:
        """{"127.0.0.1:port": pod name} of every pod the fleet has had (ports stay when a pod restarts)."""
        return {f"127.0.0.1:{p.port}": p.name for p in self.pods}

    def new_pod(self) -> Any:
        """The fleet's next pod (pod-a, pod-b, ...), not started."""
        from ops.pods import PodProcess  # noqa: PLC0415
        from ops.sidecarproc import LlamaServerPod, SidecarProcess  # noqa: PLC0415

        a, kind = self.args, self.kind
        name = f"pod-{chr(ord('a') + len(self.pods))}"
        env = {"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
        flash = ("--flash-attn", a.flash_attn) if a.flash_attn != "auto" else ()
        if a.engine == "llama-server" and kind == "sticky":
            return LlamaServerPod(name, "", a.model, flash, parallel=a.parallel, threads=a.threads,
                                  ctx_per_slot=CTX_PER_SLOT)
        common = ("--codec", a.codec, "--max-queue", str(max(a.users, 8) * 2 + 4), "--namespace", self.namespace,
                  "--budget-bytes", str(self.budget_mb << 20), "--redis-timeout-s", "2", *flash)
        if a.engine == "llama-server":
            own = ("--", "--cache-ram", str(CACHE_RAM_MIB)) if kind == "kvstash-ram" else ()
            return SidecarProcess(name, self.redis_url, a.model, (*common, "--ctx-per-slot", str(CTX_PER_SLOT), *own),
                                  no_cache=kind == "off", env=env, parallel=a.parallel, threads=a.threads)
        extra = (*common, "--engine", a.engine, "--parallel", str(a.parallel), "--threads", str(a.threads))
        if kind == "sticky":
            extra += ("--memory-kv-bytes", str(self.budget_mb << 20))
        return PodProcess(name, self.redis_url, a.model, extra, no_cache=kind != "kvstash", env=env)

    def __enter__(self) -> FleetPods:
        from ops.pods import NginxProcess, nginx_binary  # noqa: PLC0415

        if nginx_binary() is None:
            raise SystemExit("bench fleet runs through nginx: install it (apt-get install nginx-light)")
        try:
            self.pods = []
            for _ in range(self.args.pods):
                self.pods.append(self.new_pod())
                self.pods[-1].start()
            for pod in self.pods:
                pod.wait_ready()
            # max_fails 0: with nginx's passive check a pod restarted by a rollout counts as down until its first
            # request is answered (a miss, slow on a sticky pod), and the next pod's restart can leave nginx none
            # to try ("no live upstreams"); a refused connection is still tried again on the next pod
            self.balancer = NginxProcess([f"127.0.0.1:{p.port}" for p in self.pods], max_fails=0,
                                         hash_header=STICKY_HEADER if self.kind == "sticky" else None).start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def sidecar_events(self) -> dict[str, float]:
        """The sidecar pods' slot events (restores, restore_failures, reuse_misses, save_failures, restarts) and
        restored tokens, summed over the pods, each counted since its pod last started; {} for other pods."""
        import httpx  # noqa: PLC0415

        from ops.sidecarproc import SidecarProcess  # noqa: PLC0415

        totals: dict[str, float] = {}
        for pod in self.pods:
            if not isinstance(pod, SidecarProcess) or pod.proc is None:
                continue
            try:
                text = httpx.get(pod.url + "/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            for m in SIDECAR_METRIC.finditer(text):
                key = m["event"] or "restored_tokens"
                totals[key] = totals.get(key, 0.0) + float(m["value"])
        return totals

    def add_pod(self) -> Any:
        """A new pod started, and once ready added to the balancer (as a Service adds a ready endpoint)."""
        pod = self.new_pod()
        self.pods.append(pod)
        pod.start()
        pod.wait_ready()
        self.balancer.set_upstreams([f"127.0.0.1:{p.port}" for p in self.live])
        return pod

    def retire(self, pod: Any) -> None:
        """`pod` taken off the balancer (as a Service drops a terminating endpoint); the caller stops it."""
        self.retired.add(pod.name)
        self.balancer.set_upstreams([f"127.0.0.1:{p.port}" for p in self.live])

    def __exit__(self, *exc: Any) -> None:
        if self.balancer is not None:
            self.balancer.cleanup()
            self.balancer = None
        for pod in self.pods:
            pod.cleanup()
