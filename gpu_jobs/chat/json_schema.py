"""The subset of JSON Schema a tool's `parameters` may use, and the bounded check of a call's
arguments against it. Pure functions; no third-party validator.

    >>> schema = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    >>> schema_problem(schema) is None, validate({"unit": "k"}, schema)
    (True, "unit: 'k' is not one of ['c', 'f']")
    >>> schema_problem({"type": "string", "pattern": "^(.*)*$"})
    "keyword 'pattern' at # is not supported: a tool schema takes additionalProperties, default, description, enum, exclusiveMaximum, exclusiveMinimum, items, maxItems, maxLength, maximum, minItems, minLength, minimum, properties, required, title, type"

Why a subset: a client's schema is checked against every call the model writes, and full JSON
Schema lets a 2 KB schema cost 2^32 steps (`$defs` levels of `allOf: [$ref, $ref]`) or a regex
that backtracks for minutes (`pattern`), both holding the GIL. Every keyword below costs one
look per (value, schema node) pair, so a check is linear in the arguments' size times the
schema's, and `validate` stops after MAX_STEPS pairs anyway. Anything else ($ref, $defs, allOf,
anyOf, oneOf, not, pattern, patternProperties, if/then/else, format, ...) is refused by name with
its path, before the schema is used. `title`, `description` and `default` are annotations:
accepted and not checked, as in JSON Schema.
"""

from __future__ import annotations

import math
from typing import Any, Callable

__all__ = ["KEYWORDS", "MAX_NODES", "MAX_SCHEMA_DEPTH", "MAX_STEPS", "TYPES", "schema_problem", "validate"]

MAX_SCHEMA_DEPTH = 16  # nested schemas (properties / items) in one tool's parameters
MAX_NODES = 2_000  # schemas in one tool's parameters, all levels together
MAX_ENUM = 256  # values in one enum
MAX_STEPS = 200_000  # (value, schema) pairs one validate call looks at
TYPES = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
         "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
         "null": lambda v: v is None,
         "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
         "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
         or (isinstance(v, float) and v.is_integer())}


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _type_value(v: Any) -> bool:
    names = v if isinstance(v, list) else [v]
    return bool(names) and all(isinstance(t, str) and t in TYPES for t in names)


def _required(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_NODES and all(isinstance(k, str) for k in v)


# keyword -> (what its value must be, said for the error)
KEYWORDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_type_value, f"one of {', '.join(TYPES)} or a list of them"),
    "properties": (lambda v: isinstance(v, dict) and all(isinstance(s, dict) for s in v.values()),
                   "an object of schemas"),
    "items": (lambda v: isinstance(v, dict), "one schema (an object)"),
    "required": (_required, "a list of property names"),
    "enum": (lambda v: isinstance(v, list) and 0 < len(v) <= MAX_ENUM, f"a list of 1 to {MAX_ENUM} values"),
    "additionalProperties": (lambda v: isinstance(v, bool), "true or false"),
    "minimum": (_number, "a finite number"), "maximum": (_number, "a finite number"),
    "exclusiveMinimum": (_number, "a finite number"), "exclusiveMaximum": (_number, "a finite number"),
    "minLength": (_count, "a whole number >= 0"), "maxLength": (_count, "a whole number >= 0"),
    "minItems": (_count, "a whole number >= 0"), "maxItems": (_count, "a whole number >= 0"),
    "title": (lambda v: isinstance(v, str), "text"), "description": (lambda v: isinstance(v, str), "text"),
    "default": (lambda v: True, "any value"),
}


def schema_problem(schema: Any) -> str | None:
    """Why `schema` is not a tool schema of the subset (the keyword and its path), or None.
    Looks at each schema node once, at most MAX_NODES of them, MAX_SCHEMA_DEPTH deep."""
    if not isinstance(schema, dict):
        return "parameters must be a JSON schema object"
    stack, nodes = [(schema, "#", 1)], 0
    while stack:
        node, path, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            return f"the schema has more than {MAX_NODES} nested schemas"
        if depth > MAX_SCHEMA_DEPTH:
            return f"the schema is nested more than {MAX_SCHEMA_DEPTH} deep (at {path})"
        for key in sorted(node, key=str):
            if key not in KEYWORDS:
                return (f"keyword {str(key)[:60]!r} at {path} is not supported: a tool schema takes "
                        f"{', '.join(sorted(KEYWORDS))}")
            ok, wants = KEYWORDS[key]
            if not ok(node[key]):
                return f"keyword {key!r} at {path} must be {wants}"
        for name, sub in (node.get("properties") or {}).items():
            stack.append((sub, f"{path}/properties/{str(name)[:60]}", depth + 1))
        if "items" in node:
            stack.append((node["items"], f"{path}/items", depth + 1))
    return None


class _Budget(Exception):
    """validate looked at MAX_STEPS (value, schema) pairs."""


def validate(value: Any, schema: dict, max_steps: int = MAX_STEPS) -> str | None:
    """None when `value` satisfies `schema` (one schema_problem accepts), else the first
    violation as one line, `path: message` (jsonschema's wording). Stops after `max_steps`
    (value, schema) pairs and says so."""
    steps = [0]
    try:
        found = _check(value, schema, [], steps, max_steps)
    except _Budget:
        return f"the arguments are too large to check (more than {max_steps} value/schema pairs)"
    except RecursionError:  # an enum compared with a value nested past Python's limit
        return "the arguments are nested too deep to check"
    if found is None:
        return None
    where, message = found
    return f"{'/'.join(where)}: {message}" if where else message


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _check(value: Any, schema: dict, where: list[str], steps: list[int], most: int) -> tuple[list[str], str] | None:
    """(path, message) of the first violation, or None; recursion is bounded by the schema's
    depth (MAX_SCHEMA_DEPTH), not the value's."""
    steps[0] += 1
    if steps[0] > most:
        raise _Budget
    if (problem := _local(value, schema)) is not None:
        return where, problem
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, item in value.items():
            if key in props:
                if (found := _check(item, props[key], where + [str(key)], steps, most)) is not None:
                    return found
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            if (found := _check(item, schema["items"], where + [str(i)], steps, most)) is not None:
                return found
    return None


def _local(value: Any, schema: dict) -> str | None:
    """The violation of `schema`'s own keywords by `value` (not its properties' or items')."""
    kinds = schema.get("type")
    if kinds is not None:
        names = kinds if isinstance(kinds, list) else [kinds]
        if not any(TYPES[t](value) for t in names):
            return f"{_short(value)} is not of type {', '.join(map(repr, names))}"
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return f"{_short(value)} is not one of {_short(schema['enum'])}"
    if TYPES["number"](value):
        for key, bad, says in (("minimum", lambda v, b: v < b, "less than the minimum of"),
                               ("maximum", lambda v, b: v > b, "greater than the maximum of"),
                               ("exclusiveMinimum", lambda v, b: v <= b, "less than or equal to the minimum of"),
                               ("exclusiveMaximum", lambda v, b: v >= b, "greater than or equal to the maximum of")):
            if key in schema and bad(value, schema[key]):
                return f"{_short(value)} is {says} {schema[key]}"
    if isinstance(value, (str, list)):
        low, high = ("minLength", "maxLength") if isinstance(value, str) else ("minItems", "maxItems")
        if low in schema and len(value) < schema[low]:
            return f"{_short(value)} is too short"
        if high in schema and len(value) > schema[high]:
            return f"{_short(value)} is too long"
    if isinstance(value, dict):
        for key in schema.get("required") or ():
            if key not in value:
                return f"{key!r} is a required property"
        if schema.get("additionalProperties") is False:
            extra = [k for k in value if k not in (schema.get("properties") or {})]
            if extra:
                return f"Additional properties are not allowed ({', '.join(map(repr, extra[:5]))} was unexpected)"
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality for enum: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b
