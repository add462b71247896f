"""`make compose-check`: the images build, docker-compose.yml's stack runs, a chat through nginx hits, and the
dashboard's queries return series; then everything is torn down.

Steps, each a progress line: find a container engine (none running: say so, exit 0); have every base and service
image (present, pulled, or a stand-in from Debian packages where no registry is reachable: ops/localbase.py); build
the images docker-compose.yml builds (the pod, the sidecar, llama-server); bring the default profile up under a
project of its own on free host ports; wait for every pod's /readyz; hold a 6-turn chat through nginx, each later
turn a hit (the X-KV-Cache header and `usage.prompt_tokens_details.cached_tokens`); evaluate every query of the
Grafana dashboard against Prometheus; then the llama-server profile (llama-server and the sidecar beside it, from
their own images) on the same Redis, a shorter chat through the sidecar with hits; `down -v`. Exit 0 when all of it
held.

Where download.pytorch.org is out of reach, the builds get the CPU torch wheel of this machine's pip find-links as a
one-package index instead (ops/localbase.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml  # type: ignore[import-untyped]

from ops import localbase
from ops.chatclient import stream_chat
from ops.demo import QUESTIONS, SYSTEM
from ops.redisproc import free_port

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "kvstash-check"
PORT_VARS = ("KVSTASH_HTTP_PORT", "PROMETHEUS_PORT", "GRAFANA_PORT", "KVSTASH_SIDECAR_PORT")
SIDECAR_PROFILE = "llama-server"  # llama-server and the sidecar beside it
T0 = time.monotonic()


class CheckFailed(Exception):
    """One clear line: what did not hold."""


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.0f}s] {msg}", flush=True)


def run(*args: str, env: dict[str, str] | None = None, log: Path | None = None,
        timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    if log is None:
        return subprocess.run(args, capture_output=True, text=True, check=False, env=env, timeout=timeout)
    with log.open("w") as out:
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, text=True, check=False, env=env,
                              timeout=timeout)
    return subprocess.CompletedProcess(args, done.returncode, log.read_text(), "")


def compose_cli() -> list[str] | None:
    if run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


# -- images -----------------------------------------------------------------------------------

def builds(compose: dict[str, Any]) -> dict[str, str]:
    """image -> Dockerfile, for every service docker-compose.yml builds (every profile)."""
    out: dict[str, str] = {}
    for service in compose["services"].values():
        if "build" in service:
            build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
            out[service["image"]] = str(Path(build.get("context", ".")) / build.get("dockerfile", "Dockerfile"))
    return out


def base_images(dockerfile: Path) -> list[str]:
    stages: set[str] = set()
    bases = []
    for image, _, stage in re.findall(r"^FROM\s+(\S+)(\s+AS\s+(\S+))?", dockerfile.read_text(), re.M | re.I):
        if image not in stages:
            bases.append(image)
        stages.add(stage)
    return bases


def build(image: str, dockerfile: str, index_url: str, extra: list[str], logs: Path, prebuilt: Path | None) -> None:
    context, args = ROOT, ["--build-arg", f"TORCH_INDEX_URL={index_url}"]
    with tempfile.TemporaryDirectory(prefix="kvstash-ctx-") as tmp:
        if prebuilt is not None and "llamaserver" in dockerfile:  # a context of its own (the Dockerfile's header)
            context = Path(tmp)
            (context / "ops/llamaserver/prebuilt").mkdir(parents=True)
            shutil.copy(prebuilt, context / "ops/llamaserver/prebuilt/llama-server")
            args = ["--build-arg", "PREBUILT=1"]
            say(f"  {image}: the prebuilt {prebuilt} instead of a compile")
        log = logs / f"build-{re.sub(r'[^a-z0-9]+', '-', image)}.log"
        started = time.monotonic()
        done = run("docker", "build", "--force-rm", *extra, *args, "-f", str(ROOT / dockerfile), "-t", image,
                   str(context), env=localbase.legacy_builder(), log=log)
    if done.returncode != 0:
        raise CheckFailed(f"{image} did not build ({dockerfile}); the end of {log}:\n{done.stdout[-3000:]}")
    cached = done.stdout.count("Using cache") + done.stdout.count(" CACHED")  # legacy builder, BuildKit
    steps = len(re.findall(r"^(?:Step \d+/\d+|#\d+ \[(?:[\w-]+ +)?\d+/\d+\])", done.stdout, re.M))
    say(f"  {image} built from {dockerfile} in {time.monotonic() - started:.0f} s "
        f"({cached} of {steps} steps from the layer cache)")


SIDECAR_DOCKERFILE = "ops/sidecar/Dockerfile"
ENGINE_MODULES = ("torch", "transformers", "llama_cpp")


def check_slim(image: str) -> None:
    """The sidecar's image holds no engine runtime (torch, transformers, llama-cpp-python); its size, said."""
    probe = ("import importlib.util as u, sys; "
             f"sys.exit(sum(u.find_spec(m) is not None for m in {ENGINE_MODULES!r}))")
    done = run("docker", "run", "--rm", "--entrypoint", "python", image, "-c", probe)
    if done.returncode != 0:
        raise CheckFailed(f"{image} holds {done.returncode} of {', '.join(ENGINE_MODULES)}: the sidecar needs none"
                          + (f" ({done.stderr.strip()[-300:]})" if done.stderr.strip() else ""))
    size = run("docker", "image", "inspect", "-f", "{{.Size}}", image).stdout.strip()
    say(f"  {image}: no torch, transformers or llama-cpp-python in it; {int(size or 0) / 1e6:.0f} MB")


# -- the stack --------------------------------------------------------------------------------

class Stack:
    """docker-compose.yml up under its own project, on free host ports."""

    def __init__(self, cli: list[str], services: list[str]) -> None:
        self.cli, self.services = cli, services
        self.ports = {var: free_port() for var in PORT_VARS}
        self.env = {**os.environ, **{k: str(v) for k, v in self.ports.items()},
                    "KVSTASH_API_KEYS": "", "KVSTASH_TENANT_SECRET": ""}

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return run(*self.cli, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), "--profile", SIDECAR_PROFILE,
                   *args, env=self.env, timeout=timeout)

    def url(self, var: str) -> str:
        return f"http://127.0.0.1:{self.ports[var]}"

    def address(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}"
        ips = run("docker", "inspect", "-f", fmt, cid).stdout.split() if cid else []
        if not ips:
            raise CheckFailed(f"{service}: no running container")
        return ips[0]

    def up(self, *services: str) -> None:
        done = self.compose("up", "-d", "--no-build", *(services or self.services))
        if done.returncode != 0:
            raise CheckFailed(f"compose up failed:\n{done.stderr[-3000:]}")

    def down(self) -> None:
        done = self.compose("down", "-v", "--remove-orphans", "--timeout", "30")
        left = run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        say(f"down: {'ok' if done.returncode == 0 and not left else 'FAILED: ' + done.stderr[-500:]}"
            f"{'; containers left: ' + ' '.join(left) if left else ''}")

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "25").stdout[-6000:]


def wait_for(what: str, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            response = httpx.get(url, timeout=3)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:120]}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(1)
    raise CheckFailed(f"{what} not ready after {timeout_s:.0f} s ({url}: {last})")


def metric(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def chat(base: str, via: str, pods: dict[str, str], turns: int, max_tokens: int) -> None:
    """`turns` turns to `base`; every pod's writes drained between turns, every later turn must hit."""
    with httpx.Client(timeout=300) as client:
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        messages = [{"role": "system", "content": SYSTEM}]
        say(f"chat: {turns} turns through {via} ({base}), model {model}, {max_tokens} tokens a reply")
        say(f"  {'turn':>4}  {'pod':<6} {'cache':<8} {'prompt':>6} {'cached':>6} {'TTFT ms':>8}")
        served, misses = set(), []
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": QUESTIONS[turn - 1]})
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            result = stream_chat(client, base, body)
            if result.status != 200:
                raise CheckFailed(f"turn {turn}: HTTP {result.status}: {result.text[:300]}")
            say(f"  {turn:>4}  {result.pod:<6} {result.cache:<8} {result.prompt_tokens:>6} "
                f"{result.cached_tokens:>6} {result.ttft_ms:>8.0f}")
            served.add(result.pod)
            if turn > 1 and (result.cache not in ("hit", "partial") or result.cached_tokens <= 0):
                misses.append(turn)
            messages.append({"role": "assistant", "content": result.text})
            deadline = time.monotonic() + 60  # the reply's blocks in Redis before the next turn asks another pod
            while any(metric(client.get(f"http://{ip}:8000/metrics").text, "kvstash_write_queue_depth")
                      for ip in pods.values()):
                if time.monotonic() > deadline:
                    raise CheckFailed(f"turn {turn}: the pods' write queues did not drain in 60 s")
                time.sleep(0.2)
    if misses:
        raise CheckFailed(f"turns {misses} were not hits (X-KV-Cache hit/partial with cached tokens)")
    say(f"chat: turns 2..{turns} all hits; pods that served: {', '.join(sorted(served))}")


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "ops/grafana/dashboards/kvstash.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def check_queries(prometheus: str, pod_metrics: str, timeout_s: float) -> None:
    """Every dashboard query evaluates; empty only where a metric it reads has no samples yet (nothing dropped, no
    5xx), which the pods' /metrics shows; a metric that is neither scraped nor declared fails."""
    queries = [(title, expr.replace("$__rate_interval", "1m")) for title, expr in dashboard_queries()]

    def series(expr: str) -> int:
        reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
        if reply.get("status") != "success":
            raise CheckFailed(f"Prometheus refused {expr!r}: {reply.get('error')}")
        return len(reply["data"]["result"])

    counts: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s  # two scrapes (15 s apart) before a rate() has a value
    settled = time.monotonic()  # when the last query got its first series
    while time.monotonic() < deadline:
        now = {expr: series(expr) for _, expr in queries}
        if sum(map(bool, now.values())) > sum(map(bool, counts.values())):
            settled = time.monotonic()
        counts = now
        rated = any(n for e, n in counts.items() if "rate(" in e)  # two scrapes since the chat
        if all(counts.values()) or (rated and time.monotonic() - settled > 35):  # unchanged for two scrapes more
            break
        time.sleep(5)
    declared = set(re.findall(r"^# TYPE (\S+)", pod_metrics, re.M))
    declared |= {f"{n}_total" for n in declared} | {f"{n}_bucket" for n in declared}
    failed = []
    for title, expr in queries:
        if counts[expr]:
            note = f"{counts[expr]} series"
        else:
            names = sorted(set(re.findall(r"\b((?:kvstash|redis)_[a-z_]+)\b", expr)))
            absent = [n for n in names if not series(f"count({n})")]
            unknown = [n for n in absent if n not in declared]
            if unknown:
                failed.append(expr)
                note = f"FAILED: {', '.join(unknown)} neither scraped nor declared by the pods"
            elif absent:
                note = f"empty: {', '.join(absent)} declared, no samples yet (no such event in this run)"
            else:
                note = "empty: its metrics are scraped; no sample matches the selector (no such event)"
        say(f"  {title[:44]:<44} {note}  <- {expr[:70]}")
    if failed:
        raise CheckFailed(f"{len(failed)} dashboard queries read metrics nobody exports")


# -- main -------------------------------------------------------------------------------------

def check(args: argparse.Namespace, cli: list[str]) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    built = builds(compose)
    default = [n for n, s in compose["services"].items() if not s.get("profiles")]
    needed = {s["image"]: n for n, s in compose["services"].items() if n in default and "build" not in s}
    say("images: the bases the Dockerfiles name and the services' images")
    bases = {b for dockerfile in built.values() for b in base_images(ROOT / dockerfile)}
    for image in sorted(bases) + sorted(needed):
        how = localbase.ensure(image, say)
        say(f"  {image}: {how or 'MISSING (no registry reachable, no Debian package): its service is left out'}")
        if how is None and image in bases:
            raise CheckFailed(f"base image {image} is missing")
        if how is None:
            default.remove(needed[image])
    logs = Path(tempfile.mkdtemp(prefix="kvstash-compose-check-"))
    say(f"build: {', '.join(built)} (logs in {logs})")
    with localbase.torch_index(say) as (index_url, extra):
        for image, dockerfile in built.items():
            build(image, dockerfile, index_url, extra, logs, args.prebuilt)
    shutil.rmtree(logs)  # kept where a build failed
    for image, dockerfile in built.items():
        if dockerfile == SIDECAR_DOCKERFILE:
            check_slim(image)
    key = ROOT / ".secrets/frame_key"
    if not key.is_file():
        run("make", "-C", str(ROOT), "secrets")
    if not key.stat().st_mode & 0o004:  # compose bind-mounts the file: the pods' user (uid 10001) must read it
        raise CheckFailed(f"{key} is not readable by the pods' user: chmod 644 it (`make secrets` does now)")
    stack = Stack(cli, default)
    say(f"up: {' '.join(default)} (project {PROJECT}; nginx :{stack.ports['KVSTASH_HTTP_PORT']}, "
        f"Prometheus :{stack.ports['PROMETHEUS_PORT']})")
    try:
        stack.up()
        pods = {n: stack.address(n) for n in default if n.startswith("pod")}
        for name, ip in pods.items():
            wait_for(name, f"http://{ip}:8000/readyz", args.ready_timeout)
            say(f"  {name} ready ({ip})")
        wait_for("nginx", stack.url("KVSTASH_HTTP_PORT") + "/nginx-health", 60)
        wait_for("Prometheus", stack.url("PROMETHEUS_PORT") + "/-/ready", 60)
        signed = metric(httpx.get(f"http://{next(iter(pods.values()))}:8000/metrics").text, "kvstash_frames_signed")
        say(f"  nginx and Prometheus ready; frames signed: {'yes' if signed else 'metric absent or 0'}")
        chat(stack.url("KVSTASH_HTTP_PORT"), "nginx", pods, args.turns, args.max_tokens)
        say("Prometheus: the dashboard's queries ($__rate_interval = 1m)")
        pod_metrics = httpx.get(f"http://{next(iter(pods.values()))}:8000/metrics").text
        check_queries(stack.url("PROMETHEUS_PORT"), pod_metrics, args.query_timeout)
        if "grafana" in default:
            wait_for("Grafana", stack.url("GRAFANA_PORT") + "/api/health", 120)
            found = httpx.get(stack.url("GRAFANA_PORT") + "/api/search", params={"query": "kvstash"}).json()
            if not found:
                raise CheckFailed("Grafana runs but has no kvstash dashboard provisioned")
            say(f"Grafana: the dashboard is provisioned ({found[0].get('title')})")
        else:
            say("Grafana: not run (no image here); its dashboard's queries were checked against Prometheus above")
        if args.sidecar_turns:
            sidecar_shape(stack, args)
    except Exception:
        say("the stack's last log lines:\n" + stack.logs())
        raise
    finally:
        stack.down()


def sidecar_shape(stack: Stack, args: argparse.Namespace) -> None:
    """The profile's llama-server and the sidecar beside it (their own images) against the same Redis."""
    say(f"up: --profile {SIDECAR_PROFILE}: llama-server, sidecar (sidecar :{stack.ports['KVSTASH_SIDECAR_PORT']})")
    stack.up("llama-server", "sidecar")
    ip = stack.address("sidecar")
    wait_for("sidecar", f"http://{ip}:8000/readyz", args.ready_timeout)  # llama-server up, its slot files probed
    say(f"  sidecar ready ({ip})")
    chat(stack.url("KVSTASH_SIDECAR_PORT"), "the sidecar", {"sidecar": ip}, args.sidecar_turns, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.composecheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=6, help="chat turns (default 6)")
    parser.add_argument("--max-tokens", type=int, default=96, help="reply length a turn (default 96)")
    parser.add_argument("--ready-timeout", type=float, default=600, help="seconds a pod may take to be ready")
    parser.add_argument("--query-timeout", type=float, default=120, help="seconds to wait for the dashboard series")
    parser.add_argument("--sidecar-turns", type=int, default=3, help="turns through the llama-server profile's "
                                                                     "sidecar afterwards (default 3; 0: skip it)")
    parser.add_argument("--prebuilt", type=Path, help="a llama-server binary to put in its image instead of "
                                                      "compiling llama.cpp (native to the machine that built it)")
    args = parser.parse_args(argv)
    if not (1 <= args.turns <= len(QUESTIONS) and 0 <= args.sidecar_turns <= len(QUESTIONS)):
        parser.error(f"--turns must be in 1..{len(QUESTIONS)}, --sidecar-turns in 0..{len(QUESTIONS)}")
    if shutil.which("docker") is None or (info := run("docker", "info")).returncode != 0:
        why = "no docker CLI" if shutil.which("docker") is None else info.stderr.strip().splitlines()[-1][:160]
        print(f"compose-check: no container engine is running ({why}): nothing to check, exit 0")
        return 0
    cli = compose_cli()
    if cli is None:
        print("compose-check: a container engine runs but there is no compose CLI (docker compose plugin or "
              "docker-compose): nothing to check, exit 0")
        return 0
    say(f"engine: docker {run('docker', 'version', '-f', '{{.Server.Version}}').stdout.strip()}; "
        f"compose: {run(*cli, 'version', '--short').stdout.strip() or ' '.join(cli)}")
    try:
        check(args, cli)
    except (CheckFailed, RuntimeError) as exc:  # RuntimeError: a base image or the torch index (ops/localbase.py)
        say(f"compose-check: FAILED: {exc}")
        return 1
    say("compose-check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
