"""Build (once) and find the llama-server binary the sidecar's tests and demo run.

The source is the llama.cpp vendored in the pinned llama-cpp-python sdist, the same llama.cpp the in-process
engine links, so both write the same sequence-state layout. Nothing is fetched at build time beyond the sdist
(no curl, no OpenSSL, no prebuilt web UI). `python -m ops.llamaserver_build` is idempotent: a stamp holding the
pinned version skips the work when the binary is already there.
"""

from __future__ import annotations

import argparse
import fcntl
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
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
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
        return _build(jobs)


def _build(jobs: int) -> Path:
    started = time.monotonic()
    source = _source_dir()
    build_dir = BUILD_ROOT / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True,
                   stdout=subprocess.DEVNULL)
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build_dir / "bin" / "llama-server", BINARY.with_suffix(".tmp"))
    BINARY.with_suffix(".tmp").replace(BINARY)
    STAMP.write_text(LLAMA_CPP_PYTHON_VERSION + "\n")
    print(f"llama-server built in {time.monotonic() - started:.0f} s: {BINARY}")
    return BINARY


def main() -> None:
    parser = argparse.ArgumentParser(description="build llama-server from the pinned llama.cpp (once)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    jobs = parser.parse_args().jobs
    if BINARY.is_file() and _stamp_matches():
        print(f"llama-server {LLAMA_CPP_PYTHON_VERSION} already built: {BINARY}")
        return
    print(f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s llama.cpp "
          f"(~10 min on 2 cores, once)")
    build(jobs)


if __name__ == "__main__":
    main()
