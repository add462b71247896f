"""The benches' shaped link (ops/netlink.py): a network namespace whose loopback gives each Redis port a link of its
own. It shapes (a timed read over it follows the rate), it cleans up (on exit, Ctrl-C and SIGTERM), it carries a
two-pod conversation, and bad input is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ops.cli import main
from ops.netlink import LinkError, LinkSpec, NetLink, ping_rtt_ms
from ops.pods import PodProcess
from ops.redisproc import RedisCluster, RedisProcess
from tests.paths import ROOT
from tests.support import POD_ARGS, cached_tokens, running, settle

RATE = LinkSpec(0.2)  # 200 Mbit/s: slow enough to time on a busy 2-core machine, fast enough to stay lean


@pytest.fixture(scope="session")
def link_host() -> None:
    """Skip where no link can be made: not root, no iproute2, or a container that may not create a namespace."""
    if os.geteuid() != 0 or not shutil.which("tc") or not shutil.which("ip"):
        pytest.skip("a shaped link needs root and iproute2's ip and tc")
    try:
        with NetLink(RATE):
            pass
    except LinkError as exc:
        pytest.skip(f"no shaped link on this host: {exc}")


needs_link = pytest.mark.usefixtures("link_host")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


def _my_netns() -> int:
    return os.stat("/proc/thread-self/ns/net").st_ino


def _delay_ms() -> float:
    """5 ms one way where the kernel has netem, else 0 (the link is then rate alone)."""
    try:
        with NetLink(LinkSpec(0.2, 5.0)):
            return 5.0
    except LinkError as exc:
        if "netem" not in str(exc):
            raise
        return 0.0


@pytest.mark.parametrize("argv, says", [
    (["--link-gbit", "0.001"], "--link-gbit must be 0.01 to 100 Gbit/s"),
    (["--link-gbit", "101"], "--link-gbit must be 0.01 to 100 Gbit/s"),
    (["--link-gbit", "1", "--link-delay-ms", "1001"], "--link-delay-ms must be 0 to 1000 ms"),
    (["--link-gbit", "1", "--link-delay-ms", "-1"], "--link-delay-ms must be 0 to 1000 ms"),
    (["--link-delay-ms", "5"], "--link-delay-ms needs --link-gbit"),
    (["--redis-url", "http://127.0.0.1:1"], "unsupported Redis URL scheme 'http'"),
    (["--redis-url", "redis+cluster://127.0.0.1:1"], "cannot use Redis at redis+cluster://127.0.0.1:1"),
])
@pytest.mark.parametrize("bench", ["store", "resume", "fleet"])
def test_bad_link_or_url_is_one_line_and_exit_2(bench: str, argv: list[str], says: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    if bench == "fleet" and argv[0] == "--redis-url":
        argv = [argv[0], argv[1].replace("127.0.0.1", "localhost")]  # fleet takes a Redis on this machine only
        says = says.replace("127.0.0.1", "localhost")
    assert main(["bench", bench, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvstash: error: ") and says in err and "\n" not in err, err


def test_store_reads_an_operators_cluster_by_its_url(redis_cluster: RedisCluster, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`--redis-url redis+cluster://HOST:PORT` (parsed as a pod parses it) reads every node at once; a Cluster with
    fewer primaries than --cluster asks is refused in one line."""
    url = "redis+cluster://" + redis_cluster.url.split("//", 1)[1]
    primaries = len(redis_cluster.nodes)
    out = tmp_path / "cluster.json"
    assert main(["bench", "store", "--redis-url", url, "--block-sizes", "256K", "--reps", "2", "--tokens", "256",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cluster"] == primaries and {r["op"] for r in result["rows"]} == {"get_cluster", "get_landing"}
    capsys.readouterr()
    assert main(["bench", "store", "--redis-url", url, "--cluster", str(primaries + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"has {primaries} primaries, fewer than --cluster {primaries + 1}" in err and "\n" not in err


@needs_link
def test_link_shapes_each_port_and_cleans_up() -> None:
    home, before = _my_netns(), _namespaces()
    servers = [RedisProcess(), RedisProcess()]
    with NetLink(RATE) as link:
        assert _my_netns() != home and link.name in _namespaces()
        for server in servers:
            server.start()
        link.shape(*(s.port for s in servers))
        value = os.urandom(1 << 20)
        clients = [s.client(socket_timeout=30) for s in servers]
        for client in clients:
            for i in range(4):
                client.set(f"k{i}", value)

        def read(client: object) -> float:
            start = time.perf_counter()
            pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
            for i in range(4):
                pipe.get(f"k{i}")
            assert pipe.execute() == [value] * 4
            return time.perf_counter() - start

        arithmetic = RATE.seconds(4 << 20)  # 4 MiB at 200 Mbit/s: 168 ms
        alone = min(read(clients[0]) for _ in range(2))
        assert 0.8 * arithmetic < alone < 3 * arithmetic, (alone, arithmetic)
        with ThreadPoolExecutor(2) as pool:  # two ports, a link each: both reads at once take about as long
            both = max(pool.map(read, clients))
        assert both < 1.7 * alone, (both, alone)
        assert all(down >= 4 << 20 for down, _ in link.carried().values())  # what each port sent went its link
    assert _my_netns() == home
    assert _namespaces() == before and all(s.proc is not None and s.proc.poll() is not None for s in servers)


@needs_link
def test_link_delay_adds_to_the_round_trip() -> None:
    try:
        link = NetLink(LinkSpec(0.2, 20.0)).open()
    except LinkError as exc:
        if "netem" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        server = RedisProcess().start()
        link.shape(server.port)
        rtt = ping_rtt_ms(server.port)
        assert 40.0 <= rtt < 80.0, rtt  # 20 ms each way
    finally:
        link.close()


@needs_link
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_bench_leaves_no_namespace_or_redis(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "ops.cli", "bench", "store", "--link-gbit", "0.02",
                             "--block-sizes", "1M", "--tokens", "512", "--reps", "50"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: a suite run in the background (a shell's `&`) ignores SIGINT, and
                            # a process started ignoring it never sees a Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        # the link is built and Redis behind it: 12 MB at 20 Mbit/s takes 5 s a read, minutes a run; a read in flight
        # when the signal comes (in a thread) ends before the bench does
        line = proc.stdout.readline()
        assert line.startswith("link: 0.02 Gbit/s each way"), line + proc.stderr.read()  # type: ignore[union-attr]
        name = line.rsplit("network namespace ", 1)[1].split()[0]
        port = int(line.split("Redis port ", 1)[1].split()[0])
        assert name in _namespaces()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert name not in _namespaces()
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _listens(p, port)]


def _listens(proc_dir: Path, port: int) -> bool:
    try:
        cmdline = (proc_dir / "cmdline").read_bytes()
    except OSError:
        return False
    return b"redis-server" in cmdline and f"--port\0{port}\0".encode() in cmdline


@pytest.fixture
def linked_redis() -> Iterator[tuple[NetLink, RedisProcess]]:
    with NetLink(LinkSpec(RATE.gbit, _delay_ms())) as link:
        server = RedisProcess().start()
        try:
            link.shape(server.port)
            yield link, server
        finally:
            server.cleanup()


@needs_link
def test_two_pod_conversation_across_a_shaped_link(linked_redis: tuple[NetLink, RedisProcess]) -> None:
    """Turn 1 on pod a, turn 2 on pod b: b's hit reads a's KV from Redis over the link."""
    link, server = linked_redis
    pods = {name: PodProcess(f"pod-{name}", server.url, "tiny-random", POD_ARGS) for name in ("a", "b")}
    with running(pods) as procs:
        messages = [{"role": "system", "content": "You are a storyteller who answers at length. " * 6},
                    {"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
        body = {"model": "tiny-random", "max_tokens": 8, "temperature": 0}
        first = httpx.post(procs["a"].url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60)
        assert first.status_code == 200 and cached_tokens(first) == 0
        settle(procs["a"].url)
        reply = first.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "What happened next?"}]
        down_before = link.carried()[server.port][0]
        second = httpx.post(procs["b"].url + "/v1/chat/completions", json={**body, "messages": messages}, timeout=60)
        assert second.status_code == 200 and second.headers["x-kv-cache"] in ("hit", "partial")
        assert cached_tokens(second) >= first.json()["usage"]["prompt_tokens"] // 16 * 16 > 0
        assert link.carried()[server.port][0] > down_before  # the hit's blocks came over the link


@needs_link
def test_bench_resume_reads_its_floor_over_the_link(tmp_path: Path) -> None:
    """A process of its own: a bench's threads stay in the namespace they were started in."""
    out = tmp_path / "resume.json"
    done = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "resume", "--model", "tiny-random", "--contexts",
                           "64", "--modes", "int8", "--no-naive", "--repeat", "1", "--recompute-repeat", "1",
                           "--link-gbit", "0.2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("link: 0.2 Gbit/s each way, 0 ms one-way delay, for Redis port ")
    result = json.loads(out.read_text())
    assert result["link"]["gbit"] == 0.2 and result["link"]["links"] == 1
    floor = next(r for r in result["rows"] if r["method"] == "floor-int8")
    assert floor["link_gbit"] == 0.2 and 0 < floor["fetch_ms_p50"] <= floor["ttft_ms_p50"]
    assert floor["link_ms"] == round(floor["bytes"] * 8 / 0.2e9 * 1000, 2)
    assert result["targets"]["floor_to_link_int8_64"]["value"] == floor["to_link"]


@needs_link
def test_bench_store_puts_each_primary_of_a_cluster_behind_its_own_link(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    done = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "store", "--cluster", "3", "--link-gbit", "1",
                           "--block-sizes", "256K", "--tokens", "256", "--reps", "2", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("link: 1 Gbit/s each way") and "(a link each)" in done.stdout.splitlines()[0]
    result = json.loads(out.read_text())
    assert result["cluster"] == 3 and result["link"]["links"] == 3
    for row in result["rows"]:  # each read's arithmetic: its busiest primary's bytes over that primary's link
        assert row["links"] == 3 and row["link_ms"] == round(row["raw_busiest_node_bytes"] * 8 / 1e9 * 1000, 2)
        assert row["context_bytes"] / 3 <= row["raw_busiest_node_bytes"] <= row["context_bytes"]
        assert row["kvstash_gbit_s"] > 0 and row["gbit_s"] > 0
