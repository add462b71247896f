"""`kvstash bench quality --merge`: a run's codec rows added to a published JSON of other codecs' rows.

The README's codec table and the results page read one file (docs/results/quality.json); a codec measured later, on
the same texts and settings, joins it without measuring the others again. Its rows, per-window records and targets
replace any of the same codec and text; the exact rows stay the file's (each codec's interval is paired with the exact
run of its own windows, which its rows already carry); each merged run's machine facts, windows and codecs are kept
under "merged".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAME = ("engine", "model", "prefix", "continuation", "ends", "block_tokens", "size_tokens")  # what must match
WITHHELD = " (RoPE withheld)"  # a row `--no-rope` measured: encoded as for an engine that declares no RoPE


def withheld(row: dict[str, Any]) -> bool:
    """Whether `--no-rope` measured this row (the same spec encodes otherwise when the engine declares its RoPE)."""
    return row.get("rope") == "withheld"


def row_name(row: dict[str, Any]) -> str:
    """A row's codec as targets, merges and tables name it: its mode, and WITHHELD where `--no-rope` measured it."""
    return str(row["mode"]) + (WITHHELD if withheld(row) else "")


def merged(path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """The JSON at `path` with `report`'s codec rows in place of its own of the same codec and text; SystemExit with
    one line if `path` is not such a file or was measured otherwise."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--merge: cannot read {path}: {exc}") from None
    if not isinstance(old, dict) or not isinstance(old.get("rows"), list):
        raise SystemExit(f"--merge: {path} is not a bench quality JSON")
    differ = [k for k in SAME if old.get(k) != report.get(k)]
    if differ:
        raise SystemExit(f"--merge: {path} was measured with other settings ({', '.join(differ)}); rerun both alike")
    new = {(r["text"], row_name(r)) for r in report["rows"] if r["mode"] != "exact"}

    def kept(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [x for x in items if (x.get("text"), row_name(x)) not in new]

    out = dict(old)
    out["rows"] = kept(old["rows"]) + [r for r in report["rows"] if r["mode"] != "exact"]
    out["windows"] = kept(old.get("windows", [])) + [w for w in report.get("windows", []) if w["mode"] != "exact"]
    names = {f"{text}: {mode}" for text, mode in new}
    out["targets"] = {**{k: v for k, v in old.get("targets", {}).items() if k not in names},
                      **{k: v for k, v in report.get("targets", {}).items() if k in names}}
    seen = {t["name"] for t in old.get("texts", [])}
    out["texts"] = old.get("texts", []) + [t for t in report.get("texts", []) if t["name"] not in seen]
    out["merged"] = [*old.get("merged", []), {"machine": report.get("machine"), "windows": sorted(
        {r["windows"] for r in report["rows"]}), "modes": sorted({mode for _, mode in new})}]
    return out
