"""`make lowest` pins each core dependency at the lower bound pyproject.toml promises (ops/lowest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.lowest import lowest_pins


def test_every_core_dependency_is_pinned_at_its_lower_bound() -> None:
    pins = lowest_pins()
    assert "numpy==1.26" in pins and any(p.startswith("redis==") for p in pins)
    assert all("==" in p and ">" not in p and "[" not in p for p in pins)
    assert not any(p.split("==")[0] in ("torch", "transformers") for p in pins)  # the core runs without them


def test_a_dependency_without_a_lower_bound_is_refused(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["numpy>=1.26", "redis"]\n')
    with pytest.raises(SystemExit, match="'redis' has no lower bound"):
        lowest_pins(pyproject)
