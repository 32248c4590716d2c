"""The JSON Schema subset that tool parameters and response formats use, as a checker:
where a value breaks a schema, one line per break."""
from __future__ import annotations


def schema_errors(value, schema: dict, path: str = "$") -> list[str]:
    """Where value breaks a JSON Schema (the subset tools and response formats use); [] = valid."""
    if not isinstance(schema, dict):
        return []
    for key in ("anyOf", "oneOf"):
        if key in schema and all(schema_errors(value, s, path) for s in schema[key]):
            return [f"{path}: matches none of {key}"]
    errs = [e for s in schema.get("allOf", []) for e in schema_errors(value, s, path)]
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in enum {schema['enum']!r}")
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds or []
    checks = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
              "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None,
              "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    if kinds and not any(checks.get(k, lambda v: False)(value) for k in kinds):
        return errs + [f"{path}: expected type {'/'.join(kinds)}, got {type(value).__name__}"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing required {k!r}" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            errs.append(f"{path}: {len(value)} items outside [minItems, maxItems]")
        errs += [e for i, v in enumerate(value) for e in schema_errors(v, schema.get("items", {}), f"{path}[{i}]")]
    if isinstance(value, str) and not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
        errs.append(f"{path}: string length {len(value)} outside [minLength, maxLength]")
    return errs
