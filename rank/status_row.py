"""An instance's status as it travels on the token stream (rank/event_stream.py): msgpack rows.

:func:`status_row` turns an :class:`~rank.messages.InstanceStatusInfo` (frozen dataclasses,
tuples, dicts, numbers, strings) into plain lists and dicts; :func:`status_from_row` rebuilds it
from the field types the dataclasses declare, so a field added to the status travels without
a change here. A dataclass is a list of its fields in declaration order; a row shorter than the
class (a leader older than the router) leaves the missing fields at their defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from rank.messages import InstanceStatusInfo


def status_row(status: InstanceStatusInfo) -> list:
    """``status`` as msgpack-able lists (see the module docstring)."""
    return _encode(status)


def status_from_row(row: list) -> InstanceStatusInfo:
    """:func:`status_row`'s inverse.

    Raises:
        TypeError, ValueError: ``row`` does not have the status's shape.
    """
    return _decode(InstanceStatusInfo, row)


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_encode(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


@functools.cache
def _hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field name, resolved type) of dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _decode(kind: Any, value: Any) -> Any:
    if value is None:
        return None
    if dataclasses.is_dataclass(kind):
        return kind(**{name: _decode(hint, v) for (name, hint), v in zip(_hints(kind), value)})
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _decode(inner[0], value) if len(inner) == 1 else value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value)) if args else tuple(value)
    if origin is dict:
        return {k: _decode(args[1], v) for k, v in value.items()}
    return value
