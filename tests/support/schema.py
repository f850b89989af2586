"""A small JSON-schema checker for the schemas the server tests give tools: ``type`` (one or a
list), ``enum``, ``const``, ``properties``, ``required``, ``additionalProperties`` (a boolean or
a schema), ``items``, ``minItems``, ``maxItems``, ``anyOf``, ``minimum``, ``maximum``,
``minLength``, ``maxLength``. Any other keyword is refused, so a schema it does not understand
cannot pass unchecked. (jsonschema is not a dependency of the tests.)"""

from __future__ import annotations

KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
            "maxItems", "anyOf", "minimum", "maximum", "minLength", "maxLength", "description", "title"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, TYPES[name])


def errors(value, schema: dict, at: str = "$") -> list[str]:
    """Every way ``value`` breaks ``schema``, as ``"path: problem"``; empty when it conforms."""
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise ValueError(f"{at}: the checker does not know {sorted(unknown)}")
    out = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, n) for n in names):
            return [f"{at}: {value!r} is not of type {schema['type']}"]
    if "enum" in schema and not any(value == e and type(value) is type(e) for e in schema["enum"]):
        out.append(f"{at}: {value!r} is not one of {schema['enum']}")
    if "const" in schema and not (value == schema["const"] and type(value) is type(schema["const"])):
        out.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "anyOf" in schema and not any(not errors(value, s, at) for s in schema["anyOf"]):
        out.append(f"{at}: {value!r} matches none of anyOf")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                out.append(f"{at}: the required {name!r} is missing")
        extra = schema.get("additionalProperties", True)
        for name, v in value.items():
            if name in props:
                out += errors(v, props[name], f"{at}.{name}")
            elif extra is False:
                out.append(f"{at}: {name!r} is not allowed")
            elif isinstance(extra, dict):
                out += errors(v, extra, f"{at}.{name}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{at}: {len(value)} items, outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        if "items" in schema:
            for k, v in enumerate(value):
                out += errors(v, schema["items"], f"{at}[{k}]")
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        out.append(f"{at}: the string's length {len(value)} is out of bounds")
    if _is(value, "number") and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        out.append(f"{at}: {value} is out of bounds")
    return out
