"""Typed component configs: the checks and the error every one of them shares.

Each component with options owns one ``kw_only`` dataclass that holds its defaults and
checks them once, in ``__post_init__`` (torchtitan's per-component ``Config``):

    Checkpointer -> CheckpointerConfig      TokenLoader  -> LoaderConfig
    GoodputMeter -> MeterConfig             AlertEngine  -> AlertConfig
    Store        -> RetryPolicy

The component's keyword constructor builds its dataclass (``merge``), and the training
config (``train/config.py``) composes the same dataclasses and only parses TOML. So there is
one copy of every default and every check: two validators drift (ours did).

A bad value raises ``InvalidSetting`` naming the key and the fix. Component configs name
their own field (``keep_last``); ``from_table`` (a config from a TOML table) adds the
section (``checkpoint.keep_last``) with ``InvalidSetting.under``, so the message fits
whichever way the user set it. ``coerce`` converts TOML values and text to a field's
declared type; it checks types only, never ranges or choices (that is ``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib  # type: ignore[no-redef]

from steadytrain.errors import ConfigError

__all__ = [
    "InvalidSetting",
    "Text",
    "check",
    "check_choices",
    "coerce",
    "from_table",
    "literal_choices",
    "merge",
    "read_toml",
]

C = TypeVar("C")


class InvalidSetting(ConfigError):
    """``key = value is invalid: fix``; ``key`` is the field, or ``section.field``."""

    def __init__(self, key: str, value: Any, fix: str) -> None:
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key} = {value!r} is invalid: {fix}")

    def under(self, section: str) -> InvalidSetting:
        """The same error, its key prefixed with the TOML section it was set in."""
        return InvalidSetting(f"{section}.{self.key}", self.value, self.fix)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across loader worker processes
        return (InvalidSetting, (self.key, self.value, self.fix))


def check(cond: bool, key: str, value: Any, fix: str) -> None:
    """Raise ``InvalidSetting(key, value, fix)`` unless ``cond``."""
    if not cond:
        raise InvalidSetting(key, value, fix)


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The allowed values of a ``Literal[...]`` (or ``Literal[...] | None``) annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        values = tuple(
            v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a)
        )
        if values:
            return values + ((None,) if type(None) in args else ())
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_choices(obj: Any) -> None:
    """Check every ``Literal``-typed field of the dataclass ``obj`` holds one of its values
    (Python does not check annotations; the TOML layer relies on this check, not its own)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        choices = literal_choices(hints.get(f.name))
        value = getattr(obj, f.name)
        if choices is not None and value not in choices:
            shown = [c for c in choices if c is not None]
            raise InvalidSetting(f.name, value, f"choose one of {shown}")


def merge(cls: type[C], config: C | None, given: Mapping[str, Any]) -> C:
    """The config a component runs with: ``config`` (or ``cls``'s defaults) with the
    settings the caller gave replaced, validated once.

    ``given`` is the constructor's ``locals()``: every name that is a field of ``cls`` is a
    setting, and ``None`` means "not given". Passing them all at once means a keyword can
    never be forgotten on its way into the config.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    chosen = {k: v for k, v in given.items() if k in fields and v is not None}
    if config is None:
        missing = [
            name
            for name, f in fields.items()
            if name not in chosen
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} must be given: pass them as keywords, or "
                f"config={cls.__name__}(...)"
            )
        return cls(**chosen)
    if not isinstance(config, cls):
        raise ConfigError(f"config= must be a {cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **chosen) if chosen else config  # type: ignore[type-var]


class Text(str):
    """A value given as text (``--set key=value``, an environment variable): its type is the
    field's. Where the field says ``Any`` (a value in a table such as
    ``data.shuffle_settings``) it is read as a TOML literal."""


def _literal(text: str) -> Any:
    """``text`` as a TOML value (``4096``, ``true``, ``[1, 2]``, ``{a = 1}``), else as is."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return str(text)
    return value if isinstance(value, (bool, int, float, str, list, dict)) else str(text)


def _is_seq(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert a TOML value or a ``Text`` to the field's declared type.

    Only the type: whether the value is allowed (a ``Literal``'s choices, a range) is the
    config's own ``__post_init__`` check, which this layer never repeats.
    """
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return _literal(value) if isinstance(value, Text) else value
    if origin is Literal:
        return str(value) if isinstance(value, Text) else value
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        seq_first = isinstance(value, list) or (isinstance(value, str) and value[:1] == "[")
        members.sort(key=lambda a: not _is_seq(a) if seq_first else _is_seq(a))
        error: ConfigError | None = None
        for member in members:
            try:
                return coerce(value, member, key)
            except ConfigError as exc:
                error = error or exc
        assert error is not None
        raise error
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        text = isinstance(value, Text)  # its items are text too
        if isinstance(value, str):
            parsed = _literal(value) if value[:1] == "[" else None
            value = (
                parsed
                if isinstance(parsed, list)
                else [v for v in value.replace(" ", "").strip("[]").split(",") if v]
            )
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r} is invalid: give a list, e.g. [5, 12]")
        if origin is tuple:
            if len(value) != len(args):
                raise ConfigError(f"{key} = {value!r} is invalid: give {len(args)} values")
            items = [Text(v) if text and isinstance(v, str) else v for v in value]
            return tuple(coerce(v, a, key) for v, a in zip(items, args, strict=True))
        item = args[0] if args else Any
        return [coerce(Text(v) if text and isinstance(v, str) else v, item, key) for v in value]
    if origin is dict:
        if isinstance(value, str) and value[:1] == "{":
            value = _literal(value)
        if not isinstance(value, dict):
            raise ConfigError(f'{key} = {value!r} is invalid: give a table, e.g. {{key = "v"}}')
        _, item = typing.get_args(annotation) or (str, Any)
        return {str(k): coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return value if isinstance(value, annotation) else from_table(annotation, value, key)
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if annotation is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{key} = {value!r} is invalid: expected {name}") from None
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def from_table(cls: type, values: Any, prefix: str) -> Any:
    """``cls`` from a TOML table; errors name ``prefix.key`` (``checkpoint.keep_last``)."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{prefix}] must be a table, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {prefix}.{unknown[0]}; known keys of [{prefix}]: {sorted(fields)}"
        )
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING
        if no_default and f.default_factory is dataclasses.MISSING and name not in values:
            raise ConfigError(f"{prefix}.{name} is required: set it in [{prefix}]")
    kwargs = {k: coerce(v, hints[k], f"{prefix}.{k}") for k, v in values.items()}
    try:
        return cls(**kwargs)
    except InvalidSetting as exc:
        raise exc.under(prefix) from None


def read_toml(path: str) -> dict[str, Any]:
    """A TOML file as nested dicts; a missing or malformed file is a ``ConfigError``."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
