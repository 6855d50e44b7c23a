"""Turn YAML and pydantic errors into one :class:`ConfigError` a user can act on.

Every line names the key path (``prefill.tp``), what was found, what is allowed and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

DOCS = "see docs/config.md for every key"

_TYPE_WORDS = {
    "int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
    "dict": "a mapping (a YAML section)", "model": "a mapping (a YAML section)",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}


class ConfigError(ValueError):
    """A configuration file is unreadable or invalid; the message says where and what to do."""


def yaml_error_message(path: Path, exc: Exception) -> str:
    """One line for a YAML syntax error, with line and column when known."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return (f"{path}: not valid YAML{where}: {problem}; fix the syntax (indent with spaces, "
            "`key: value` pairs); see configs/ for examples")


def validation_error_message(path: Path, exc: ValidationError, root: type[BaseModel]) -> str:
    """All of ``exc``'s errors, one line each, under a header naming the file."""
    lines = [f"- {_describe(err, root)}" for err in exc.errors()]
    return f"invalid config {path}:\n" + "\n".join(lines) + f"\n({DOCS})"


def _describe(err: dict[str, Any], root: type[BaseModel]) -> str:
    loc = tuple(str(part) for part in err["loc"])
    key = ".".join(loc) or "(top level)"
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "cross_field":
        return err["msg"]
    if kind == "extra_forbidden":
        allowed = ", ".join(_fields_at(root, loc[:-1]))
        return (f"{key}: unknown key; allowed keys here: {allowed} (check the spelling or "
                "remove it)")
    if kind == "literal_error":
        return f"{key}: must be one of {ctx.get('expected')}, got {value!r}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"{key}: must be {_BOUNDS[kind]} {bound}, got {value!r}"
    if kind in ("string_too_short", "too_short"):
        return f"{key}: must not be empty"
    type_word = next((w for t, w in _TYPE_WORDS.items() if kind.startswith(t)), None)
    if type_word:
        return f"{key}: expected {type_word}, got {value!r} ({type(value).__name__})"
    return f"{key}: {err['msg']} (got {value!r})"


def _fields_at(root: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    """Field names of the section at ``loc`` (the root model when ``loc`` is empty)."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None or not (isinstance(field.annotation, type)
                                 and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)
