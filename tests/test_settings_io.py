"""The one settings reader: defaults < YAML file < command line, types from the dataclass
annotations, and errors that name the key, the value and where it came from."""

from dataclasses import dataclass, field

import pytest

from eagle3_jax import settings_io
from eagle3_jax.errors import ConfigError, SettingsError


@dataclass(frozen=True)
class Inner:
    width: int | None = None
    scale: float = 1.0


@dataclass(frozen=True)
class Outer:
    name: str
    steps: int = 10
    rate: float = 0.5
    fast: bool = False
    ids: tuple[int, ...] | None = None
    pair: tuple[float, float] = (0.9, 0.95)
    inner: Inner = field(default_factory=Inner)


def test_layers_override_in_order_and_nested_keys_merge(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("name: a\nsteps: 3\nrate: 1e-4\ninner:\n  width: 8\n  scale: 2\nids: [1, 2]\n")
    layers = [settings_io.yaml_layer(str(path))] + settings_io.override_layers(["steps=5", "inner.scale=3"])
    got = settings_io.from_layers(Outer, layers)
    assert got == Outer(name="a", steps=5, rate=1e-4, ids=(1, 2), inner=Inner(width=8, scale=3.0))
    assert settings_io.from_layers(Outer, [("x", {"name": "b"})]) == Outer(name="b")   # defaults


@pytest.mark.parametrize("layers, message", [
    ([("--config c.yaml", {"name": "a", "steps": "many"})],
     r"^--config c.yaml: steps: expected an integer, found str 'many'$"),
    ([("--config c.yaml", {"name": "a"}), *settings_io.override_layers(["steps=2.5"])],
     r"^command line steps=2.5: steps: expected an integer, found float 2.5$"),
    ([("--steps", {"name": "a", "steps": True})], r"^--steps: steps: expected an integer, found bool True$"),
    ([("c", {"name": "a", "fast": "yes please"})], "c: fast: expected true or false"),
    ([("c", {"name": "a", "ids": [1, "x"]})], r"c: ids\[1\]: expected an integer"),
    ([("c", {"name": "a", "pair": [0.9]})], "c: pair: expected a list of 2 values, found 1"),
    ([("c", {"name": "a", "inner": {"width": 1.5}})], "c: inner.width: expected an integer"),
    ([("c", {"name": "a", "inner": 3})], "c: inner: expected a mapping"),
    ([("c", {"nmae": "a"})], r"c: unknown key 'nmae' \(did you mean 'name'\?\); valid keys: name, steps"),
    ([("c", {"name": "a", "inner": {"widht": 1}})], r"c: inner: unknown key 'widht' \(did you mean 'width'\?\)"),
    ([("c", {"steps": 1})], "'name' is required"),
])
def test_errors_name_key_value_and_source(layers, message):
    with pytest.raises(SettingsError, match=message) as info:
        settings_io.from_layers(Outer, layers)
    assert isinstance(info.value, ConfigError) and info.value.exit_code == 2


def test_overrides_need_key_value_and_valid_yaml():
    with pytest.raises(SettingsError, match="command line: 'steps' is not key=value"):
        settings_io.override_layers(["steps"])
    with pytest.raises(SettingsError, match=r"command line ids=\[1, : the value is not valid YAML"):
        settings_io.override_layers(["ids=[1, "])


def test_describe_defaults_lists_every_key():
    text = settings_io.describe_defaults(Outer)
    assert "  name: (required)" in text and "  steps: 10" in text and "  ids: null" in text
    assert "  pair: [0.9, 0.95]" in text and "  inner: {width: null, scale: 1.0}" in text
