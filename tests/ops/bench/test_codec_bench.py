"""`kvstash bench codec` runs end to end (synthetic KV, tiny sizes) and writes its JSON rows."""

from __future__ import annotations

import json
from pathlib import Path

from ops.cli import main


def test_bench_codec_synthetic_writes_rows(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "codec.json"
    assert main(["bench", "codec", "--synthetic", "--tokens", "40", "--repeat", "1",
                 "--groups", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["source"] == "synthetic" and report["memcpy_mb_s"] > 0
    rows = {r["spec"]: r for r in report["rows"]}
    # 3 modes x 3 compressors; int4 plain (its default) and rotv; int2 plain, rotv/clip (its default) and rotv
    assert len(rows) == 9 + 2 * 3 + 3 * 3
    assert {"int4+zstd:3/g32/plain", "int4+lz4/g32/rotv", "int2+lz4/g32/rotv/clip", "int2+none/g32/rotv"} <= set(rows)
    assert rows["int2+lz4/g32/rotv/clip"]["default_variant"] and not rows["int2+lz4/g32/plain"]["default_variant"]
    assert rows["int4+lz4/g32/plain"]["default_variant"] and not rows["int4+lz4/g32/rotv"]["default_variant"]
    for field in ("ratio_vs_fp16", "encode_mb_s", "decode_mb_s", "k_rel_err", "v_rel_err"):
        assert all(r[field] >= 0 for r in rows.values()), field
    assert rows["exact+none"]["k_rel_err"] == 0.0 and rows["int2+none/g32/plain"]["v_rel_err"] > 0
    assert "SYNTHETIC" in capsys.readouterr().err  # type: ignore[attr-defined]
