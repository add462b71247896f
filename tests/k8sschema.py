"""Test helper (no tests): validate Kubernetes manifests against tests/k8s_schema.json, a pinned subset of the API's
schema, with the few JSON Schema keywords it uses (type, enum, required, properties, additionalProperties, items,
minItems, minimum, maximum, pattern, maxLength, $ref). No dependency: the subset is small and fixed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

SCHEMA = json.loads((Path(__file__).parent / "k8s_schema.json").read_text())
TYPES: dict[str, tuple[type, ...]] = {"object": (dict,), "array": (list,), "string": (str,), "integer": (int,),
                                      "number": (int, float), "boolean": (bool,)}


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = SCHEMA["definitions"][schema["$ref"].removeprefix("#/definitions/")]
    return schema


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False  # YAML's true is no number
    return isinstance(value, TYPES[kind])


def errors(value: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """Every way `value` breaks `schema`, as `path: what` lines (none: it conforms)."""
    schema = _resolve(schema)
    where = at or "(top)"
    kinds = schema.get("type")
    if kinds is not None and not any(_is(value, k) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return [f"{where}: {value!r} is not of type {kinds}"]
    out: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
        if len(value) > schema.get("maxLength", len(value)):
            out.append(f"{where}: {value!r} is longer than {schema['maxLength']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            out.append(f"{where}: {value} is outside {schema.get('minimum')}..{schema.get('maximum')}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{where}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            out += errors(item, schema.get("items", {}), f"{at}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {name!r} is required" for name in schema.get("required", []) if name not in value]
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            path = f"{at}.{name}" if at else name
            if name in props:
                out += errors(item, props[name], path)
            elif extra is False:
                out.append(f"{where}: unknown field {name!r}")
            elif isinstance(extra, dict):
                out += errors(item, extra, path)
    return out


def manifest_errors(doc: dict[str, Any]) -> list[str]:
    """`errors` of one manifest, under the schema of its kind."""
    kind = doc.get("kind")
    if kind not in SCHEMA["kinds"]:
        return [f"kind {kind!r} is not in the schema"]
    return errors(doc, SCHEMA["kinds"][kind])
