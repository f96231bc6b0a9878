"""One reader for every settings dataclass (train config, serve settings, the demo's demo.yaml).

Settings arrive in layers, lowest first: the dataclass defaults, a YAML file, then the command line,
each named by where it came from, so an error names the key, the bad value and its source. Values
are checked against the dataclass annotations; nested dataclasses merge key by key across layers
(``draft.head_dim=16`` on the command line keeps the file's other draft keys).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from eagle3_jax.config import read_yaml_mapping
from eagle3_jax.errors import SettingsError

# (where the values came from, the values)
Layer = tuple[str, Mapping[str, Any]]
# Other programs' names for a setting (dotted key -> ours), offered as "did you mean" when used.
Aliases = Mapping[str, str]
# Per dotted key: turns a value from a file or the command line into the annotated type's form
# (e.g. a mesh given as a YAML mapping into its "data=1,expert=8" string) before type checking.
Converters = Mapping[str, Callable[[Any], Any]]


def yaml_layer(path: str, where: str | None = None) -> Layer:
    """A YAML file as a layer, named the way the command line gave it."""
    where = where or f"--config {path}"
    return where, read_yaml_mapping(path, where=where)


def override_layers(items: Iterable[str], example: str = "lr=1e-4") -> list[Layer]:
    """``key=value`` command-line items, one layer each; values are read as YAML scalars / lists and a
    dotted key (``draft.head_dim=16``) sets one key of a nested setting."""
    layers = []
    for item in items:
        if "=" not in item:
            raise SettingsError(f"command line: '{item}' is not key=value (e.g. {example})")
        key, text = item.split("=", 1)
        key = key.strip()
        source = f"command line {key}={text}"
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise SettingsError(f"{source}: the value is not valid YAML") from None
        *parents, leaf = key.split(".")
        mapping: dict = {leaf: value}
        for parent in reversed(parents):
            mapping = {parent: mapping}
        layers.append((source, mapping))
    return layers


def from_layers(cls, layers: Sequence[Layer], converters: Converters | None = None,
                required: Mapping[str, str] | None = None, aliases: Aliases | None = None):
    """An instance of dataclass ``cls``: its defaults, overridden by each layer in turn.

    ``required``: for a field without a default, how to give it (said when no layer does).
    ``aliases``: names other programs use for a setting, suggested when one is used here.
    """
    values = _merge(cls, layers, dict(converters or {}), prefix="", aliases=dict(aliases or {}))
    for f in dataclasses.fields(cls):
        if (f.init and f.name not in values and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            how = (required or {}).get(f.name, f"set {f.name}: in the file or pass {f.name}=VALUE")
            raise SettingsError(f"'{f.name}' is required: {how}")
    return cls(**values)


def field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def unknown_keys_message(source: str, unknown: Sequence[str], names: Sequence[str], prefix: str = "",
                         aliases: Aliases | None = None) -> str:
    """``source: unknown key 'x' (did you mean 'y'?); valid keys: ...``; a known alias beats a close spelling."""
    described = []
    for key in unknown:
        alias = (aliases or {}).get(prefix + str(key))
        close = [alias] if alias else difflib.get_close_matches(str(key), names, n=1)
        described.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    noun = "key" if len(unknown) == 1 else "keys"
    where = f"{source}: {prefix.rstrip('.')}: " if prefix else f"{source}: "
    return f"{where}unknown {noun} {', '.join(described)}; valid keys: {', '.join(names)}"


def _merge(cls, layers: Sequence[Layer], converters: dict, prefix: str, aliases: dict) -> dict:
    hints = typing.get_type_hints(cls)
    names = field_names(cls)
    values: dict[str, Any] = {}
    nested: dict[str, list[Layer]] = {}
    for source, mapping in layers:
        if not isinstance(mapping, Mapping):
            raise SettingsError(f"{source}: {prefix.rstrip('.') or 'settings'}: expected a mapping of keys to "
                                f"values, found {type(mapping).__name__} {mapping!r}")
        unknown = [k for k in mapping if k not in names]
        if unknown:
            raise SettingsError(unknown_keys_message(source, unknown, names, prefix, aliases))
        for key, value in mapping.items():
            path = prefix + key
            if path in converters:
                value = converters[path](value)
            tp = hints[key]
            if dataclasses.is_dataclass(tp):
                if isinstance(value, tp):
                    values[key] = value
                    nested.pop(key, None)
                elif value is None:        # back to the nested defaults
                    values.pop(key, None)
                    nested[key] = []
                else:
                    values.pop(key, None)
                    nested.setdefault(key, []).append((source, value))
                continue
            try:
                values[key] = coerce(value, tp, path)
            except SettingsError as e:
                raise SettingsError(f"{source}: {e}") from None
    for key, sub_layers in nested.items():
        values[key] = hints[key](**_merge(hints[key], sub_layers, converters, f"{prefix}{key}.", aliases))
    return values


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def coerce(value: Any, tp, where: str) -> Any:
    """``value`` checked against annotation ``tp``; ints widen to floats, lists become tuples."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except SettingsError as e:
                errors.append(e)
        raise errors[0]
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise SettingsError(f"{where}: expected a list, found {type(value).__name__} {value!r}")
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            items = tuple(coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        elif len(value) != len(args):
            raise SettingsError(f"{where}: expected a list of {len(args)} values, found {len(value)}: {list(value)}")
        else:
            items = tuple(coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        return list(items) if origin is list else items
    if tp not in _EXPECTED:
        raise SettingsError(f"{where}: unsupported setting type {_type_name(tp)}")
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    elif isinstance(value, tp) or (tp is float and isinstance(value, int)):
        if not isinstance(value, bool) or tp is bool:
            return float(value) if tp is float else value
    raise SettingsError(f"{where}: expected {_EXPECTED[tp]}, found {type(value).__name__} {value!r}")


def mesh_text(value: Any) -> Any:
    """A mesh written as a YAML mapping (``mesh: {data: 1, expert: 8}``) as its command-line string."""
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return value


def describe_defaults(cls, indent: str = "  ") -> str:
    """One line per setting, ``name: default``, for ``--help`` texts."""
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        if dataclasses.is_dataclass(default):
            default = "{" + ", ".join(f"{k}: {'null' if v is None else v}"
                                      for k, v in dataclasses.asdict(default).items()) + "}"
        elif isinstance(default, tuple):
            default = list(default)
        lines.append(f"{indent}{f.name}: {'null' if default is None else default}")
    return "\n".join(lines)
