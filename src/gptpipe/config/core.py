"""Strict YAML → typed dataclass loading, shared by every stage.

A stage config is a dataclass whose fields are declared with :func:`option`, which carries a one-line
doc used by ``--help``. Loading is strict: unknown keys, wrong types, impossible values and cross-field
contradictions are all collected and raised once, as a :class:`ConfigError` naming file, line and key.

Paths (fields typed ``Path``) written in a YAML file are relative to that file's folder; paths given as
command-line overrides are relative to the current directory, like any other shell argument. A field typed
``Url | Path`` also takes an object-storage URL (``s3://…``, ``gs://…``, any fsspec protocol), kept exactly as
written (gptpipe.storage reads and writes it); a URL in a ``Path``-only field is an error, never a mangled path.

A config class checks its own values in ``check()``. A check that needs code which itself imports the config (a
registry of plugins whose choice is a config value, e.g. stage 7's task kinds) is named in the class attribute
``checked_by = "module:function"`` (function(config) -> [(key, problem)]) and run after ``check()``, so every
loader applies it and the config module imports nothing above it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def has_scheme(value: Any) -> bool:
    """True for a string written as ``scheme://…`` (a URL), False for a local path."""
    return isinstance(value, str) and bool(_SCHEME.match(value))


class Url(str):
    """A config value written as ``scheme://…``, kept as written; ``url / "name"`` joins like a Path."""

    def __truediv__(self, part: str) -> Url:
        return Url(f"{self.rstrip('/')}/{str(part).lstrip('/')}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]


# user:secret@ in a URL: what a message may never echo.
_CREDENTIAL = re.compile(r"(?<=://)[^/@\s'\"]+@")


def redact(text: str) -> str:
    """`text` with the credential of any URL in it (scheme://user:secret@host) replaced by ***."""
    return _CREDENTIAL.sub("***@", text)


class ConfigError(ValueError):
    """Every problem found in one config, reported together before any work starts (URLs' credentials
    redacted: a message may be pasted anywhere)."""

    def __init__(self, source: str, problems: list[str]):
        problems = [redact(p) for p in problems]
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in {source}:\n{lines}")


def option(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """Declare a config field with its default and the one-line doc that ``--help`` prints."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


class _LineLoader(yaml.SafeLoader):
    """A SafeLoader that also remembers the line of every mapping key, for error messages."""


def _compose_with_lines(text: str, filename: str) -> tuple[Any, dict[str, int]]:
    """safe_load ``text`` and return (data, {dotted.key: line number})."""
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}

        def walk(n: yaml.Node, prefix: str) -> None:
            if isinstance(n, yaml.MappingNode):
                for key_node, value_node in n.value:
                    dotted = f"{prefix}{key_node.value}"
                    lines[dotted] = key_node.start_mark.line + 1
                    walk(value_node, dotted + ".")
            elif isinstance(n, yaml.SequenceNode):
                for i, item in enumerate(n.value):
                    lines[f"{prefix}{i}"] = item.start_mark.line + 1
                    walk(item, f"{prefix}{i}.")

        if node is not None:
            walk(node, "")
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise ConfigError(filename, [f"not valid YAML: {exc}"]) from None
    finally:
        loader.dispose()
    return data, lines


def parse_override(text: str) -> tuple[str, Any]:
    """``train.lr=3e-4`` → ("train.lr", 3e-4). The value is read as YAML, so ``[a, b]`` is a list."""
    if "=" not in text:
        raise ConfigError("command line", [f"override {text!r} must look like section.key=value"])
    key, raw = text.split("=", 1)
    key = key.strip().removeprefix("--")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML reads "1e-4" as a string (no dot); numbers-as-strings are fixed up by the type coercion.
    return key, value


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    node: Any = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"dict[{_type_name(k)}, {_type_name(v)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _Builder:
    """Turns raw YAML data into dataclass instances, collecting every problem on the way."""

    def __init__(self, source: str, lines: dict[str, int], base_dir: Path, override_keys: set[str]):
        self.source = source
        self.lines = lines
        self.base_dir = base_dir
        self.override_keys = override_keys
        self.problems: list[str] = []

    def from_override(self, key: str) -> bool:
        """True for an overridden key and for everything below it (list items, sub-keys)."""
        return any(key == k or key.startswith(k + ".") for k in self.override_keys)

    def where(self, key: str) -> str:
        if self.from_override(key):
            return f"command-line override {key}"
        line = self.lines.get(key)
        return f"{self.source}:{line} {key}" if line else f"{self.source} {key}"

    def problem(self, key: str, message: str) -> None:
        self.problems.append(f"{self.where(key)}: {message}")

    def build(self, cls: type, data: Any, prefix: str) -> Any:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.problem(prefix.rstrip(".") or "(top level)", f"expected a mapping of keys, got {type(data).__name__}")
            data = {}
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        for key in data:
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
                hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(fields)}"
                self.problem(f"{prefix}{key}", f"unknown key{hint}")
        kwargs = {}
        problems_before = len(self.problems)
        for name, f in fields.items():
            key = f"{prefix}{name}"
            if name in data:
                kwargs[name] = self.coerce(hints[name], data[name], key)
            elif f.default is not dataclasses.MISSING:
                # Defaults go through the same coercion, so default paths resolve against the YAML's folder.
                kwargs[name] = self.coerce(hints[name], to_plain(f.default), key)
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                kwargs[name] = self.coerce(hints[name], to_plain(f.default_factory()), key)  # type: ignore[misc]
            else:
                self.problem(key, "required key is missing")
        try:
            instance = cls(**kwargs)
        except TypeError as exc:  # a missing required field, already reported
            self.problems.append(f"{self.source}: {exc}")
            return None
        # Value and cross-field checks assume the types are right, so they run only when they are.
        if hasattr(instance, "check") and len(self.problems) == problems_before:
            for key, message in instance.check():
                self.problem(f"{prefix}{key}", message)
        if getattr(cls, "checked_by", None) and len(self.problems) == problems_before:
            module, function = cls.checked_by.split(":")
            for key, message in getattr(importlib.import_module(module), function)(instance):
                self.problem(f"{prefix}{key}", message)
        return instance

    def coerce(self, tp: Any, value: Any, key: str) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:
                return self.coerce(non_none[0], value, key)
            for candidate in non_none:  # first type that accepts the value without complaint
                saved = len(self.problems)
                result = self.coerce(candidate, value, key)
                if len(self.problems) == saved:
                    return result
                del self.problems[saved:]
            self.problem(key, f"expected {_type_name(tp)}, got {value!r}")
            return value
        if origin is Literal:
            if value not in args:
                close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.problem(key, f"must be one of {', '.join(repr(a) for a in args)}, got {value!r}{hint}")
            return value
        if origin is list:
            if isinstance(value, (str, dict)) or not isinstance(value, (list, tuple)):
                value = [value]  # a single item where a list is expected is a list of one
            return [self.coerce(args[0], v, f"{key}.{i}") for i, v in enumerate(value)]
        if origin is dict:
            if not isinstance(value, dict):
                self.problem(key, f"expected a mapping, got {value!r}")
                return {}
            return {k: self.coerce(args[1], v, f"{key}.{k}") for k, v in value.items()}
        if _is_dataclass_type(tp):
            return self.build(tp, value, key + ".")
        if tp is Any:
            return value
        if tp is bool:
            if not isinstance(value, bool):
                self.problem(key, f"expected true or false, got {value!r}")
            return value
        if tp is int:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                self.problem(key, f"expected an integer, got {value!r}")
                return value
            try:
                number = float(str(value).replace("_", ""))
            except (ValueError, OverflowError):
                self.problem(key, f"expected an integer, got {value!r}")
                return value
            if not math.isfinite(number):
                self.problem(key, f"expected a finite integer, got {value!r}")
                return value
            if number != int(number):
                self.problem(key, f"expected an integer, got {value!r}")
            return int(number)
        if tp is float:
            if isinstance(value, bool):
                self.problem(key, f"expected a number, got {value!r}")
                return value
            try:
                number = float(value)
            except (TypeError, ValueError, OverflowError):
                self.problem(key, f"expected a number, got {value!r}")
                return value
            if not math.isfinite(number):
                self.problem(key, f"expected a finite number, got {value!r}")
            return number
        if tp is str:
            if isinstance(value, (dict, list)) or value is None:
                self.problem(key, f"expected a string, got {value!r}")
                return value
            return str(value)
        if tp is Url:
            if not has_scheme(value):
                self.problem(key, f"expected a URL (scheme://...), got {value!r}")
                return value
            return Url(value)
        if tp is Path:
            if not isinstance(value, (str, Path)):
                self.problem(key, f"expected a path, got {value!r}")
                return value
            if has_scheme(value):
                self.problem(key, f"{value!r} is a URL, but this key takes a local path only")
                return value
            path = Path(value).expanduser()
            base = Path.cwd() if self.from_override(key) else self.base_dir
            return path if path.is_absolute() else (base / path).resolve()
        raise TypeError(f"config field {key} has unsupported type {tp!r}")


def load_config(cls: type, path: Path | None, overrides: list[str] = ()) -> Any:
    """Read ``path`` (YAML, safe_load) into ``cls``, apply ``key=value`` overrides, validate everything.

    Raises :class:`ConfigError` listing every problem at once.
    """
    source = str(path) if path else "defaults"
    data: Any = {}
    lines: dict[str, int] = {}
    if path is not None:
        if not Path(path).is_file():
            what = "is a folder, not a YAML file" if Path(path).is_dir() else "does not exist"
            raise ConfigError(source, [f"config file {path} {what}"])
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            line = Path(path).read_bytes()[:exc.start].count(b"\n") + 1
            raise ConfigError(source, [f"{path}:{line}: not UTF-8 text (byte {exc.object[exc.start]:#04x}); save the "
                                       "file as UTF-8"]) from None
        data, lines = _compose_with_lines(text, source)
        data = data or {}
    parsed = [parse_override(o) for o in overrides]
    if not isinstance(data, dict):
        raise ConfigError(source, ["the top level must be a mapping of keys"])
    problems = []
    for key, value in parsed:
        try:
            _set_dotted(data, key, value)
        except (IndexError, ValueError, AttributeError, TypeError):
            problems.append(f"command-line override {key}: no such list item or section")
    base_dir = Path(path).resolve().parent if path else Path.cwd()
    builder = _Builder(source, lines, base_dir, {k for k, _ in parsed})
    config = builder.build(cls, data, "")
    problems += builder.problems
    if problems:
        raise ConfigError(source, problems)
    return config


def config_from_plain(cls: type, data: dict[str, Any], source: str) -> Any:
    """Rebuild a config from :func:`to_plain` output (paths in it are already absolute), e.g. the run record
    a checkpoint carries; raises :class:`ConfigError` naming ``source`` when it no longer fits ``cls``."""
    builder = _Builder(source, {}, Path.cwd(), set())
    config = builder.build(cls, data, "")
    if builder.problems:
        raise ConfigError(source, builder.problems)
    return config


def to_plain(config: Any) -> Any:
    """A dataclass tree as YAML/JSON-ready plain data (paths as strings)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_plain(v) for v in config]
    if isinstance(config, dict):
        return {str(k): to_plain(v) for k, v in config.items()}
    if isinstance(config, (Path, Url)):
        return str(config)
    return config


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every field, recursively: the body of ``--help``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            rows += describe(tp, f"{prefix}{f.name}.")
            continue
        if typing.get_origin(tp) is list and _is_dataclass_type(typing.get_args(tp)[0]):
            rows.append((f"{prefix}{f.name}", "list", "", f.metadata.get("doc", "") + "; each item has:"))
            rows += describe(typing.get_args(tp)[0], f"{prefix}{f.name}.N.")
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(to_plain(f.default))
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(to_plain(f.default_factory()))  # type: ignore[misc]
        else:
            default = "(required)"
        rows.append((f"{prefix}{f.name}", _type_name(tp), default, f.metadata.get("doc", "")))
    return rows
