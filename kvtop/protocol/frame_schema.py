"""The stats frame's JSON Schema, derived from its types (kvtop/protocol/frame.py), and
`check_frame`: is this a frame the dashboard can draw?

`frame_schema()` walks `StatsFrame`'s TypedDicts: a TypedDict is an object whose required keys are
its non-`NotRequired` ones, `Literal` a const or an enum, `X | None` adds "null", `list[X]` and
`dict[str, X]` their items, and `Schema(...)` in `Annotated` adds its keywords (bounds, pattern,
description). The tests validate engine frames against it with jsonschema (a dev dependency);
`python -m kvtop.protocol.frame_schema` prints it for anyone else's tools.

Replay reads frames from files anyone can hand it; one that is not a stats frame must be a clear
message, not a traceback deep in a widget. `check_frame` checks what the renderers index into:
`required` keys, `type`s, `const` and `enum`, through `properties`, `items` and
`additionalProperties`. Bounds (`minimum`, `pattern`…) are left to the full JSON Schema in the
tests: a frame with a negative count draws oddly, it does not crash.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,
    Required,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

from kvtop.protocol.frame import SCHEMA_VERSION, Schema, StatsFrame

TYPES = {  # JSON gives exact types: `type(v) is int` leaves bool out, and is fast
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "string": lambda v: type(v) is str,
    "boolean": lambda v: type(v) is bool,
    "null": lambda v: v is None,
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) is int or (type(v) is float and math.isfinite(v)),
}
_SIMPLE = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}


@cache
def frame_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a stats frame, from `StatsFrame`."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://kvtop.invalid/schemas/stats-frame-{SCHEMA_VERSION}.json",
        "title": f"kvtop stats frame, schema {SCHEMA_VERSION}",
        **json_schema(StatsFrame),
    }
    return schema


def json_schema(tp: Any) -> dict:
    """The JSON Schema of one type of the frame's vocabulary (see the module's docstring)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        schema = json_schema(args[0])
        for extra in args[1:]:
            if isinstance(extra, Schema):
                schema.update(extra.keywords)
        return schema
    if origin in (Required, NotRequired):
        return json_schema(args[0])
    if is_typeddict(tp):
        return _object(tp)
    if tp in _SIMPLE:
        return {"type": _SIMPLE[tp]}
    if tp is Any:
        return {}
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin in (Union, types.UnionType):
        return _union([json_schema(a) for a in args])
    if origin is list:
        return {"type": "array", **({"items": json_schema(args[0])} if args and args[0] is not Any else {})}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": json_schema(args[1])} if args[1] is not Any else {})}
    raise TypeError(f"the frame's types have no JSON Schema for {tp!r}")


def _object(td: type) -> dict:
    hints = get_type_hints(td, include_extras=True)
    schema: dict = {"type": "object"}
    if td.__doc__:
        schema["description"] = " ".join(td.__doc__.split())
    schema["required"] = [k for k in hints if k in td.__required_keys__]
    schema["properties"] = {k: json_schema(v) for k, v in hints.items()}
    return schema


def _union(members: list[dict]) -> dict:
    """`A | B`: their types listed together, their other keywords merged (the frame's unions are
    `X | None`, where nothing but the type differs)."""
    out: dict = {}
    kinds: list[str] = []
    for m in members:
        kind = m.get("type")
        kinds += [kind] if isinstance(kind, str) else list(kind or ())
        out.update({k: v for k, v in m.items() if k != "type"})
    return {"type": kinds, **out}


@dataclass(eq=False)
class _Node:
    """One schema node, ready to check values against."""

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
    schema = frame_schema()
    return _compile(schema)


def _compile(schema: dict) -> _Node:
    kinds = schema.get("type", ())
    node = _Node(
        types=(kinds,) if isinstance(kinds, str) else tuple(kinds),
        const=(schema["const"],) if "const" in schema else (),
        enum=schema.get("enum"),
        required=tuple(schema.get("required", ())),
    )
    checks = [TYPES[t] for t in node.types if t in TYPES]
    if checks:
        node.ok = checks[0] if len(checks) == 1 else lambda v: any(c(v) for c in checks)
    node.props = {k: _compile(v) for k, v in schema.get("properties", {}).items()}
    if isinstance(schema.get("additionalProperties"), dict):
        node.extra = _compile(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        node.items = _compile(schema["items"])
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


if __name__ == "__main__":
    print(json.dumps(frame_schema(), indent=2, ensure_ascii=False))
