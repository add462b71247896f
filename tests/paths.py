"""Where things are, for tests (no tests): the project's root and the tests' own data, wherever a test module sits."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GOLDEN = TESTS / "golden"  # golden frames (tests/golden/cases.py writes them)
OPS = ROOT / "ops"
