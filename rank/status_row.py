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
from collections.abc import Callable
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
    return _decoder(InstanceStatusInfo)(row)


def merge_rows(old: list | None, new: list | None) -> list | None:
    """One status row standing for two reports where only ``new`` will be sent (``old`` was
    not): ``new`` with ``old``'s KV transfer records before its own. A leader hands each
    record out once, so dropping ``old`` would lose its records from the router's metrics."""
    if old is None or new is None:
        return new if new is not None else old
    before = status_from_row(old).transfers
    if not before:
        return new
    status = status_from_row(new)
    return status_row(dataclasses.replace(status, transfers=before + status.transfers))


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return [_encode(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


@functools.cache
def _decoder(kind: Any) -> Callable[[Any], Any]:
    """A function that rebuilds a value of type ``kind`` from its row; built once per type
    (NOTE: a status arrives about once a second per instance and per router: decoding walks
    no type hints per value)."""
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        fields = [(f.name, _decoder(hints[f.name])) for f in dataclasses.fields(kind)]
        return lambda row: kind(**{name: dec(v) for (name, dec), v in zip(fields, row)})
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        dec = _decoder(inner[0]) if len(inner) == 1 else _plain
        return lambda v: None if v is None else dec(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _decoder(args[0])
        return tuple if item is _plain else (lambda v: tuple(item(x) for x in v))
    if origin is tuple and args:
        items = [_decoder(a) for a in args]
        return lambda v: tuple(dec(x) for dec, x in zip(items, v))
    if origin is tuple:
        return tuple
    if origin is dict:
        value = _decoder(args[1])
        return dict if value is _plain else (lambda v: {k: value(x) for k, x in v.items()})
    return _plain


def _plain(value: Any) -> Any:
    return value
