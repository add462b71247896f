"""`kvstash sidecar --spawn` leaves as a pod does: SIGTERM to its process group with completions in flight; it is not
ready at once, refuses new connections, lets llama-server finish them, writes back what they computed, exits 0, and
only then stops its llama-server (which the group signal did not reach). Real llama-server, real redis-server."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.llamaserver_build import binary_path
from ops.redisproc import RedisProcess
from ops.sidecarproc import SidecarProcess
from tests.faultkit import QUESTIONS
from tests.leaving import Stream, next_turn, readyz
from tests.support import running
from tests.timing import wait_for

pytestmark = pytest.mark.skipif(binary_path() is None, reason="no llama-server built: run `make setup`")
BLOCK = 16
ARGS = ("--block-tokens", str(BLOCK), "--log-level", "info", "--drain-grace-s", "240")


def children(pid: int, name: str) -> list[int]:
    """Processes called `name` whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat.split(" (", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) == pid and comm == name[:15]:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def sidecars(redis_server: RedisProcess) -> Iterator[dict[str, SidecarProcess]]:
    """`leaving`, whose replies do not wait for their writes (only its drain writes them), and `reader`."""
    with running({
        "leaving": SidecarProcess("side-leaving", redis_server.url, extra_args=ARGS,
                                  env={"KVSTASH_WRITE_WAIT_S": "0"}),
        "reader": SidecarProcess("side-reader", redis_server.url, extra_args=(*ARGS, "--fetch-policy", "always")),
    }, ready_s=300) as procs:
        yield procs


def test_sidecar_drains_then_stops_its_llama_server(sidecars: dict[str, SidecarProcess]) -> None:
    side, reader = sidecars["leaving"], sidecars["reader"]
    assert side.proc is not None
    (server,) = children(side.proc.pid, "llama-server")  # the llama-server it spawned
    streams = [Stream(side.url, [{"role": "user", "content": f"{q} Answer at length. ({i})"}], 64).start()
               for i, q in enumerate(QUESTIONS[:2])]
    for s in streams:
        assert s.first.wait(240) and s.error is None, s.error
    unfinished = sum(not s.done for s in streams)
    os.killpg(side.proc.pid, signal.SIGTERM)  # as a terminal's Ctrl-C or a container stop reaches the group
    seen: list[int | str] = []
    wait_for(lambda: seen.append(readyz(side.url)) or seen[-1] == "closed", "the listener to close",
             timeout_s=120)
    assert 200 not in seen, seen
    for s in streams:
        s.join(240)
        assert s.error is None and s.done and s.finish_reason in ("stop", "length"), (s.error, s.text)
    assert side.proc.wait(timeout=240) == 0, side.log_tail()
    assert not alive(server), "the spawned llama-server outlived its sidecar"
    log = side.log_tail(200)
    assert "draining on SIGTERM" in log and "0 writes queued; exiting" in log
    assert unfinished, "every stream had ended before the signal: nothing was in flight"
    for s in streams:  # written back: the next turn, on another sidecar, reads the reply's blocks too
        assert s.usage is not None
        cached = int(next_turn(reader, s).headers["x-kv-cached-tokens"])
        assert cached > s.usage["prompt_tokens"] // BLOCK * BLOCK, (cached, s.usage)
