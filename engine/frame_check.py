"""Is this a stats frame? A light structural check driven by `engine/stats_schema.json`.

Replay reads frames from files anyone can hand it; one that is not a stats frame must be a
clear message, not a traceback deep in a widget. This checks what the renderers index into:
`required` keys, `type`s, `const` and `enum`, through `properties`, `items`, `additionalProperties`
and local `$ref`s. Bounds (`minimum`, `pattern`…) are left to the full JSON Schema in the tests:
a frame with a negative count draws oddly, it does not crash. jsonschema is only a dev dependency.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("stats_schema.json")
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
}


@cache
def stats_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def check_frame(frame: Any) -> str | None:
    """None for a frame the dashboard can draw, else what is wrong with it, in a few words."""
    if not isinstance(frame, dict):
        return f"a JSON {_kind(frame)}, not an object"
    root = stats_schema()
    stack: list[tuple[Any, dict, str]] = [(frame, root, "")]
    while stack:  # no recursion: a frame's depth is the file's choice, not ours
        value, schema, where = stack.pop()
        schema = _resolve(root, schema)
        problem = _check_one(value, schema)
        if problem:
            return f"{where or 'the frame'}: {problem}"
        if isinstance(value, dict):
            props = schema.get("properties", {})
            extra = schema.get("additionalProperties")
            for key, item in value.items():
                sub = props.get(key, extra if isinstance(extra, dict) else None)
                if sub is not None:
                    stack.append((item, sub, f"{where}.{key}" if where else key))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            stack.extend((item, schema["items"], f"{where}[{i}]") for i, item in enumerate(value))
    return None


def _resolve(root: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    if not ref:
        return schema
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return {**node, **{k: v for k, v in schema.items() if k != "$ref"}}


def _check_one(value: Any, schema: dict) -> str | None:
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        if not any(TYPES[t](value) for t in names if t in TYPES):
            return f"expected {' or '.join(names)}, found a JSON {_kind(value)}"
    if "const" in schema and value != schema["const"]:
        return f"expected {schema['const']!r}, found {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"expected one of {', '.join(map(str, schema['enum']))}, found {_short(value)}"
    if isinstance(value, dict):
        missing = [k for k in schema.get("required", ()) if k not in value]
        if missing:
            return f"missing {', '.join(missing)}"
    return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number" if math.isfinite(value) else "non-finite number"
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, dict | list) else f"a JSON {_kind(value)}"
    return text if len(text) <= 40 else text[:37] + "…"
