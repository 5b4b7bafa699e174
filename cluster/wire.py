"""The msgpack encoding of records that cross processes: plans, results, requests, deltas."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Callable

import msgpack

# Fields that hold live Python objects (a grammar's `allowed` callable) and so stay in-process.
LOCAL_ONLY = frozenset({"constraint"})


class WireError(ValueError):
    """A record that cannot be sent to another process; the message names the field."""


def pack(record) -> bytes:
    """A dataclass record (nested records, lists, tuples and scalars inside) as msgpack bytes."""
    return msgpack.packb(record, default=_field_values, use_bin_type=True)


def unpack(cls, data: bytes):
    """The `cls` record (or `list[cls]`) that `pack` encoded; nested records are rebuilt from the
    type hints."""
    return _decoder(cls)(msgpack.unpackb(data, raw=False, strict_map_key=False))


def _field_values(value) -> list:
    """A record as the list of its fields; msgpack packs lists and scalars itself."""
    if not dataclasses.is_dataclass(value):
        raise WireError(f"cannot encode a {type(value).__name__}")
    for name in LOCAL_ONLY & _names(type(value)):
        if getattr(value, name) is not None:
            raise WireError(f"{type(value).__name__}.{name} is set: a grammar constraint cannot be "
                            f"sent to a worker in another process (run it in-process)")
    return [getattr(value, f.name) for f in _fields(type(value))]


@functools.cache
def _decoder(hint) -> Callable:
    """A function from msgpack's plain values to `hint`'s type, built once per type: the step loop
    decodes a plan and a result every step."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        parts = [(f.name, _decoder(hints[f.name])) for f in _fields(hint)]
        return lambda v: hint(**{name: d(x) for (name, d), x in zip(parts, v)})
    if origin is list:
        item = _decoder(args[0])
        return (lambda v: list(v)) if item is _same else (lambda v: [item(x) for x in v])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])
            return lambda v: tuple(item(x) for x in v)
        items = [_decoder(a) for a in args]
        return lambda v: tuple(d(x) for d, x in zip(items, v))
    return _same


def _same(value):
    return value


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.name not in LOCAL_ONLY)


@functools.cache
def _names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))
