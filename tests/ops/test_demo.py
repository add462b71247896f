"""`kvstash demo` end to end with the tiny model: hits on later turns, identical replies, clean shutdown."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.timing import wait_for


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "ops.cli", "demo", "--model", "tiny-random", "--max-tokens", "12",
            "--block-tokens", "16",
            *args]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_demo_reports_hits_and_identical_replies(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = subprocess.run(_demo("--turns", "3", "--codec", "exact", "--json", str(out)),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    for key in ("turn", "pod", "prompt_tokens", "cached_tokens", "ttft_ms", "ttft_ms_nocache", "identical"):
        assert all(key in t for t in turns)
    assert turns[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in turns[1:])
    # sent the moment the previous reply ended, each turn still reused everything some pod had computed
    assert all(t["cached_tokens"] == t["possible_tokens"] > 0 for t in turns[1:]), turns
    assert len({t["pod"] for t in turns}) == 3  # round robin: every turn on another pod
    assert report["all_identical"] is True and "speedup" in report
    assert "every reply was identical" in done.stdout


def test_demo_cleans_up_on_ctrl_c() -> None:
    proc = subprocess.Popen(_demo("--turns", "8", "--max-tokens", "200"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    ports: list[int] = []
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        ports += [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line)]
        if line.startswith("turn"):
            break
    assert len(ports) >= 5, ports  # redis + 3 pods + the no-cache pod
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    # what the demo started is gone (a child's sockets close as it exits)
    wait_for(lambda: not [p for p in ports if _listening(p)], f"nothing listening on {ports}", 10)


# a Python whose import of llama_cpp fails as it does where the optional `llamacpp` extra is not installed
_WITHOUT_LLAMA_CPP = """
import sys
from importlib.abc import MetaPathFinder

class WithoutLlamaCpp(MetaPathFinder):
    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            return None
        for finder in self.finders:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                return spec
        return None

sys.meta_path[:] = [WithoutLlamaCpp(list(sys.meta_path))]
from ops.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_llamacpp_without_its_extra_is_one_line() -> None:
    """Without llama-cpp-python, `--engine llamacpp` is refused before anything starts, in one line naming the extra;
    the default hf demo does not need it."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_LLAMA_CPP, "demo", "--engine", "llamacpp"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvstash: error: the llamacpp engine needs llama-cpp-python, an optional extra: "
        "pip install -e '.[llamacpp]' (make setup installs it)"]
    assert "redis" not in done.stdout  # nothing was started
