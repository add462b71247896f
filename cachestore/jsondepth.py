"""How deep a JSON text nests, found before parsing it.

`json.loads` recurses once a level, so a hostile body of nested brackets drives the interpreter to its recursion limit;
a finalizer that the garbage collector happens to run down there fails as well, where nobody can catch it. Measuring
the depth on the raw bytes first keeps untrusted JSON from ever going deep.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 32  # what kvstash parses from outside: request bodies, session files, session records

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def nesting_depth(data: bytes | str) -> int:
    """The deepest bracket nesting outside string literals (an unterminated string counts as structure)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    skeleton = _STRING.sub(b"", raw)
    if not skeleton:
        return 0
    depth = np.cumsum(_STEP[np.frombuffer(skeleton, dtype=np.uint8)], dtype=np.int32)
    return max(0, int(depth.max()))


def loads(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` of untrusted text, refusing (with `json.JSONDecodeError`) one that nests deeper than `max_depth`."""
    if nesting_depth(data) > max_depth:  # at position 0: the message needs none of the text (not decoded for it)
        raise json.JSONDecodeError(f"nests deeper than {max_depth} levels", "", 0)
    return json.loads(data)
