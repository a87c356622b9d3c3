"""Fifty JSON schemas for structured-output checks, and a small validator for the keywords they use
(written apart from the grammar library, so that it checks that library's output rather than
repeating it)."""
from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 24}
_I = {"type": "integer", "minimum": 0, "maximum": 10000}


def _obj(props: dict, required: list | None = None, extra: bool = False) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if not extra:
        out["additionalProperties"] = False
    return out


def schemas() -> list[dict]:
    """The fifty schemas: flat records, enums, numbers, arrays, nesting, optional fields, unions."""
    fields = ["name", "city", "title", "author", "colour", "language", "country", "label", "kind", "owner"]
    out: list[dict] = []
    for i, f in enumerate(fields):                                      # 10 flat records
        out.append(_obj({f: _S, "count": _I, "active": {"type": "boolean"}}))
    for i in range(10):                                                 # 10 enums and constants
        choices = [f"v{i}{j}" for j in range(2 + i % 4)]
        out.append(_obj({"state": {"enum": choices}, "level": {"type": "integer", "minimum": 1, "maximum": 5}}))
    for i in range(10):                                                 # 10 arrays
        item = [_S, _I, {"type": "boolean"}, {"type": "number", "minimum": -100, "maximum": 100}, {"enum": ["a", "b"]}][i % 5]
        out.append(_obj({"items": {"type": "array", "items": item, "minItems": 1, "maxItems": 1 + i % 4}}))
    for i in range(10):                                                 # 10 nested objects
        inner = _obj({"street": _S, "number": _I}) if i % 2 else _obj({"x": _I, "y": _I})
        out.append(_obj({"id": _I, "where": inner, "notes": {"type": "array", "items": _S, "maxItems": 2}}))
    for i in range(10):                                                 # 10 optional fields, nulls and unions
        out.append(_obj({"id": _I, "nickname": _S, "score": {"anyOf": [{"type": "null"}, _I]},
                         "mode": {"type": ["string", "null"], "maxLength": 8}},
                        required=["id"] if i % 2 else ["id", "score"]))
    return out


def valid(value: Any, schema: dict) -> bool:
    """Whether ``value`` meets ``schema`` (the keywords ``schemas`` uses)."""
    if "anyOf" in schema:
        return any(valid(value, s) for s in schema["anyOf"])
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    kinds = schema.get("type")
    if kinds is not None and not any(_is(value, k) for k in (kinds if isinstance(kinds, list) else [kinds])):
        return False
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return False
    if _is(value, "number") and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(valid(v, schema.get("items", {})) for v in value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties", True) is False and any(k not in props for k in value):
            return False
        return all(valid(v, props[k]) for k, v in value.items() if k in props)
    return True


def _is(value: Any, kind: str) -> bool:
    return {"object": lambda: isinstance(value, dict), "array": lambda: isinstance(value, list),
            "string": lambda: isinstance(value, str), "boolean": lambda: isinstance(value, bool),
            "null": lambda: value is None,
            "integer": lambda: isinstance(value, int) and not isinstance(value, bool),
            "number": lambda: isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]()
