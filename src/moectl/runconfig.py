"""Run configs: one dataclass per kind of run, one way to save, load, check and copy it.

A run's settings (a pretraining run, an options training run, an offloaded serving run, an
evaluation, a τ search) travel as one dataclass deriving from :class:`RunConfig`. The command line
only parses its flags into that dataclass and calls the library's ``run(config)``; a Python user
builds the same dataclass and calls the same function, and a run's folder keeps the config it ran
with (``config.save(folder / "config.json")``) so it can be redone with ``Config.load``. This is
the shape of PEFT's adapter configs (``save_pretrained`` / ``from_pretrained`` of a dataclass).

Values are checked against the field's annotation when the config is made from a mapping
(``from_dict``, ``load``): ``"seq_len": "256"`` or ``"bf16": 1`` in a file is refused with the
field's name and the type it takes, never carried into a run. A subclass adds the range checks of
its own fields in ``__post_init__`` (raising :class:`moectl.errors.ConfigError`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from moectl.errors import ConfigError
from moectl.io.atomic import write_text_atomic

C = TypeVar("C", bound="RunConfig")


class RunConfig:
    """Mixin of a ``@dataclass`` run config: ``to_dict``, ``from_dict``, ``save``, ``load``, ``with_``.

    ``kind`` names the config in errors (``"run config"`` unless a subclass says otherwise).
    """

    kind: ClassVar[str] = "run config"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values of every field (paths as strings, tuples as lists)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], *, source: str = "", unknown: str = "error") -> C:
        """A config from ``data``, every value checked against its field's type.

        ``unknown``: ``"error"`` refuses keys that are not fields (a typo in a hand-written file),
        ``"ignore"`` drops them (a file written by a newer moectl). ``source`` prefixes errors.
        """
        where = f"{source}: " if source else ""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}a {cls.kind} is a JSON object of settings, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        extra = sorted(k for k in data if k not in known)
        if extra and unknown == "error":
            raise ConfigError(
                f"{where}unknown {cls.kind} setting(s) {', '.join(map(repr, extra))}; allowed: {', '.join(known)}"
            )
        hints = typing.get_type_hints(cls)
        values = {}
        for name, value in data.items():
            if name not in known:
                continue
            try:
                values[name] = _check(value, hints[name])
            except _Mismatch as err:
                raise ConfigError(f"{where}{cls.kind} setting {name!r} must be {err}, got {value!r}") from None
            except ConfigError as err:  # a nested run config (its own from_dict) refused a value
                raise ConfigError(f"{where}{cls.kind} setting {name!r}: {err}") from None
        missing = [
            n
            for n, f in known.items()
            if n not in values
            and f.init
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(f"{where}{cls.kind} is missing required setting(s) {', '.join(missing)}")
        try:
            return cls(**values)
        except ConfigError as err:
            raise ConfigError(f"{where}{err}") from None
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}not a valid {cls.kind} ({' '.join(str(err).split())[:200]})") from None

    def save(self, path: str | Path) -> Path:
        """Write the config as indented JSON, atomically."""
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls: type[C], path: str | Path, *, unknown: str = "error") -> C:
        """A saved config; :class:`ConfigError` naming the file when it is not one."""
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such {cls.kind} file") from None
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the {cls.kind} ({err.strerror or err})") from None
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ConfigError(f"{path}: not a JSON {cls.kind} ({type(err).__name__})") from None
        return cls.from_dict(data, source=str(path), unknown=unknown)

    def with_(self: C, **changes: Any) -> C:
        """A copy with ``changes`` applied (and checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


class _Mismatch(Exception):
    """A value does not fit an annotation; the message says what the annotation takes."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _check(value: Any, hint: Any) -> Any:
    """``value`` converted to ``hint`` where JSON cannot say it (tuple, Path, float from int), else as is.

    Raises ``_Mismatch`` naming what ``hint`` takes.
    """
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _check(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch(" or ".join(_name(a) for a in args))
    if origin is typing.Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        raise _Mismatch("one of " + ", ".join(map(repr, args)))
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch("null")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch("true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch("an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch("a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise _Mismatch("a string")
    if hint is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _Mismatch("a path (string)")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(_name(hint))
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _Mismatch(_name(hint))
            return tuple(_check(v, a) for v, a in zip(value, args, strict=True))
        inner = args[0] if args else Any
        items = [_check(v, inner) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _Mismatch("a JSON object")
        if args:
            return {_check(k, args[0]): _check(v, args[1]) for k, v in value.items()}
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if issubclass(hint, RunConfig) and isinstance(value, Mapping):
            return hint.from_dict(value)  # a nested run config: its values checked too
        if isinstance(value, Mapping):
            try:
                return hint(**value)
            except (TypeError, ValueError) as err:
                raise _Mismatch(f"a {hint.__name__} object ({err})") from None
        raise _Mismatch(f"a {hint.__name__} object")
    if isinstance(hint, type):
        if isinstance(value, hint):
            return value
        raise _Mismatch(_name(hint))
    return value  # an annotation this checker does not know: left to the config's own checks


def _name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin in (tuple, list):
        args = typing.get_args(hint)
        return f"a list of {len(args)} values" if origin is tuple and args and args[-1] is not Ellipsis else "a list"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
