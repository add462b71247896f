"""Build (once) and find the llama-server binary the sidecar's tests and demo run.

The source is the llama.cpp vendored in the pinned llama-cpp-python sdist, the same llama.cpp the in-process
engine links, so both write the same sequence-state layout. Nothing is fetched at build time beyond the sdist
(no curl, no OpenSSL, no prebuilt web UI). `python -m ops.llamaserver_build` is idempotent: a stamp holding the
pinned version skips the work when the binary is already there.

A build is also kept in the user's cache (`$KVSTASH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvstash`, else
`~/.cache/kvstash`), keyed by the pinned version, the build flags, the compiler and this CPU's features (the build is
native), so a fresh clone or a new virtualenv on the same machine copies it instead of compiling for ten minutes, as
pip reuses the llama-cpp-python wheel it built. `KVSTASH_CACHE_DIR=off` turns that off.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = ROOT / ".venv" / "llama-server"
BINARY = BUILD_ROOT / "bin" / "llama-server"  # = service.engines.llama.llamaserverproc.DEFAULT_BINARY
STAMP = BUILD_ROOT / "version"

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


def cached_binary() -> Path | None:
    """Where this machine's user cache keeps a build of the pinned llama-server (None: the cache is off)."""
    root = os.environ.get("KVSTASH_CACHE_DIR", "")
    if root == "off":
        return None
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstash"
    return base / "llama-server" / f"{LLAMA_CPP_PYTHON_VERSION}-{_build_key()}" / "llama-server"


def _build_key() -> str:
    """The flags, the compiler and the CPU features a native build depends on, hashed."""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    try:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True, check=False).stdout
    except OSError:
        cc = ""
    text = "\n".join([*CMAKE_FLAGS, platform.machine(), cpu, cc])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def binary_path() -> Path | None:
    """The llama-server `make setup` built, or None (tests skip on None only when no build was possible)."""
    return BINARY if BINARY.is_file() and _stamp_matches() else None


def _stamp_matches() -> bool:
    return STAMP.is_file() and STAMP.read_text().strip() == LLAMA_CPP_PYTHON_VERSION


def _source_dir() -> Path:
    """The extracted vendor/llama.cpp of the pinned sdist, downloaded through pip into the build root."""
    sdist_dir = BUILD_ROOT / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    tarball = sdist_dir / f"{name}.tar.gz"
    if not tarball.is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdist_dir)],
            check=True,
        )
    source = BUILD_ROOT / "src"
    vendor = source / name / "vendor" / "llama.cpp"
    if not (vendor / "CMakeLists.txt").is_file():
        shutil.rmtree(source, ignore_errors=True)
        with tarfile.open(tarball) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(f"{name}/vendor/llama.cpp/")]
            archive.extractall(source, members=members, filter="data")
    return vendor


def build(jobs: int = 2) -> Path:
    """Build llama-server unless the stamped binary is already there; returns its path."""
    if BINARY.is_file() and _stamp_matches():
        return BINARY
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with (BUILD_ROOT / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make setup` meanwhile waits for this build, then skips
        if BINARY.is_file() and _stamp_matches():
            return BINARY
        if _from_cache():
            return BINARY
        return _build(jobs)


def _install(source: Path) -> None:
    """Put the binary at `source` in place, atomically, and stamp it."""
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, BINARY.with_suffix(".tmp"))
    BINARY.with_suffix(".tmp").replace(BINARY)
    STAMP.write_text(LLAMA_CPP_PYTHON_VERSION + "\n")


def _from_cache() -> bool:
    """Install the user cache's build for this machine, if there is one that runs."""
    cached = cached_binary()
    if cached is None or not cached.is_file():
        return False
    probe = subprocess.run([str(cached), "--version"], capture_output=True, check=False)
    if probe.returncode != 0:
        return False
    _install(cached)
    print(f"llama-server {LLAMA_CPP_PYTHON_VERSION}: copied this machine's earlier build from {cached}")
    return True


def _to_cache() -> None:
    """Keep the new build in the user cache (best effort: a read-only home only costs the next clone a build)."""
    cached = cached_binary()
    if cached is None:
        return
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(BINARY, cached.with_suffix(".tmp"))
        cached.with_suffix(".tmp").replace(cached)
    except OSError as exc:
        print(f"llama-server: not kept in {cached.parent} ({exc})")


def _build(jobs: int) -> Path:
    print(f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s llama.cpp "
          f"(~10 min on 2 cores, once per machine)", flush=True)
    started = time.monotonic()
    source = _source_dir()
    build_dir = BUILD_ROOT / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True,
                   stdout=subprocess.DEVNULL)
    _install(build_dir / "bin" / "llama-server")
    _to_cache()
    print(f"llama-server built in {time.monotonic() - started:.0f} s: {BINARY}")
    return BINARY


def main() -> None:
    parser = argparse.ArgumentParser(description="build llama-server from the pinned llama.cpp (once)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    jobs = parser.parse_args().jobs
    if BINARY.is_file() and _stamp_matches():
        print(f"llama-server {LLAMA_CPP_PYTHON_VERSION} already built: {BINARY}")
        cached = cached_binary()
        if cached is not None and not cached.is_file():
            _to_cache()  # a build from before the cache: keep it for the next clone
        return
    build(jobs)


if __name__ == "__main__":
    main()
