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
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).with_name("stats_schema.json")
TYPES = {  # JSON gives exact types: `type(v) is int` leaves bool out, and is fast
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "string": lambda v: type(v) is str,
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) is int or (type(v) is float and math.isfinite(v)),
}


@cache
def stats_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@dataclass(eq=False)
class _Node:
    """One schema node with its `$ref` resolved, ready to check values against."""

    types: tuple[str, ...] = ()
    ok: Callable[[Any], bool] | None = None  # the type check
    const: tuple = ()  # () or (the value,)
    enum: list | None = None
    required: tuple[str, ...] = ()
    props: dict[str, _Node] = field(default_factory=dict)
    extra: _Node | None = None
    items: _Node | None = None
    leaf: bool = True  # nothing under it to check
    strict: bool = False  # a const or an enum to check besides the type


@cache
def _root() -> _Node:
    schema = stats_schema()
    return _compile(schema, schema, {})


def _compile(schema: dict, root: dict, seen: dict[int, _Node]) -> _Node:
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    types = schema.get("type", ())
    node = _Node(
        types=(types,) if isinstance(types, str) else tuple(types),
        const=(schema["const"],) if "const" in schema else (),
        enum=schema.get("enum"),
        required=tuple(schema.get("required", ())),
    )
    checks = [TYPES[t] for t in node.types if t in TYPES]
    if checks:
        node.ok = checks[0] if len(checks) == 1 else lambda v: any(c(v) for c in checks)
    node.props = {k: _compile(v, root, seen) for k, v in schema.get("properties", {}).items()}
    if isinstance(schema.get("additionalProperties"), dict):
        node.extra = _compile(schema["additionalProperties"], root, seen)
    if isinstance(schema.get("items"), dict):
        node.items = _compile(schema["items"], root, seen)
    node.leaf = not (node.props or node.extra or node.items or node.required)
    node.strict = bool(node.const) or node.enum is not None
    return node


PARTIAL_REQUIRED = ("schema", "ts", "engine")  # what a partial frame (another engine's /metrics) must still carry


def check_frame(frame: Any) -> str | None:
    """None for a frame the dashboard can draw, else what is wrong with it, in a few words.
    A partial frame (`source.kind` "metrics": DESIGN §6) may leave out what its engine cannot
    know, and say null for it; what it does carry is checked like any other frame's."""
    if not isinstance(frame, dict):
        return f"a JSON {_kind(frame)}, not an object"
    partial = isinstance(frame.get("source"), dict) and frame["source"].get("kind") == "metrics"
    if partial:
        missing = [k for k in PARTIAL_REQUIRED if k not in frame]
        if missing:
            return f"the frame: missing {', '.join(missing)}"
    # no recursion (a frame's depth is the file's choice, not ours); leaves are checked in place,
    # and a path is only spelt out for an error: 100,000 sequences must check in about a second
    stack: list[tuple[Any, _Node, str]] = [(frame, _root(), "")]
    while stack:
        value, node, where = stack.pop()
        if partial and value is None:
            continue
        problem = _check_one(value, node, partial)
        if problem:
            return f"{where or 'the frame'}: {problem}"
        if isinstance(value, dict):
            props, extra = node.props, node.extra
            for key, item in value.items():
                sub = props.get(key, extra)
                if sub is None:
                    continue
                if not sub.leaf:
                    stack.append((item, sub, f"{where}.{key}" if where else key))
                elif ((sub.ok is not None and not sub.ok(item)) or sub.strict) and not (partial and item is None):
                    problem = _check_one(item, sub)
                    if problem:
                        return f"{where}.{key}: {problem}" if where else f"{key}: {problem}"
        elif isinstance(value, list) and node.items is not None:
            sub = node.items
            for i, item in enumerate(value):
                if not sub.leaf:
                    stack.append((item, sub, f"{where}[{i}]"))
                elif (sub.ok is not None and not sub.ok(item)) or sub.strict:
                    problem = _check_one(item, sub)
                    if problem:
                        return f"{where}[{i}]: {problem}"
    return None


def _check_one(value: Any, node: _Node, partial: bool = False) -> str | None:
    if node.ok is not None and not node.ok(value):
        return f"expected {' or '.join(node.types)}, found a JSON {_kind(value)}"
    if node.const and value != node.const[0]:
        return f"expected {node.const[0]!r}, found {_short(value)}"
    if node.enum is not None and value not in node.enum:
        return f"expected one of {', '.join(map(str, node.enum))}, found {_short(value)}"
    if node.required and isinstance(value, dict) and not partial:
        missing = [k for k in node.required if k not in value]
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
