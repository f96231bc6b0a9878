"""The registry of draft kinds. Each kind is a package here whose ``KIND`` (a ``DraftKind``) holds
everything that differs between kinds. Everything outside this package finds a draft's kind here
(by architecture, config, module or name) and calls what it holds; nothing else compares kinds. A
new kind is a package plus one entry in ``KINDS`` (docs/architecture.md walks through one).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from eagle3_jax.drafts import dflash, eagle3, peagle
from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.drafts.kind import DraftKind
from eagle3_jax.drafts.loaded import DraftOutput, LoadedDraft
from eagle3_jax.errors import ConfigError

# The first kind is the default: a draft config.json without ``architectures`` is read as one.
KINDS: tuple[DraftKind, ...] = (eagle3.KIND, peagle.KIND, dflash.KIND)
NAMES = tuple(k.name for k in KINDS)
ARCHITECTURES = tuple(a for k in KINDS for a in k.architectures)

__all__ = ["ARCHITECTURES", "KINDS", "NAMES", "DraftConfig", "DraftKind", "DraftOutput", "LoadedDraft", "by_name",
           "for_architectures", "of_config", "of_module", "read_config"]


def by_name(name: str) -> DraftKind:
    for k in KINDS:
        if k.name == name:
            return k
    raise ConfigError(f"draft kind '{name}' is not one of {NAMES}")


def for_architectures(architectures) -> DraftKind | None:
    """The kind a config.json's ``architectures`` names (None when it names none of ours)."""
    for a in architectures or ():
        for k in KINDS:
            if a in k.architectures:
                return k
    return None


def of_config(cfg) -> DraftKind:
    """The kind of a draft config (the most derived config class it is an instance of)."""
    return _most_derived(cfg, "config")


def of_module(module) -> DraftKind:
    """The kind of a draft's NNX module (also of one merged inside a jitted program)."""
    return _most_derived(module, "module")


def _most_derived(obj, field: str) -> DraftKind:
    # One kind may extend another's classes (P-EAGLE's config extends EAGLE-3's): the subclass wins.
    matches = [k for k in KINDS if isinstance(obj, getattr(k, field))]
    if not matches:
        raise ConfigError(f"{type(obj).__name__} is no draft kind's {field}; known kinds: {NAMES}")
    return max(matches, key=lambda k: len(getattr(k, field).__mro__))


def read_config(source: str | os.PathLike | Mapping[str, Any], where: str | None = None):
    """The config of a draft of any kind, from its directory, its config.json path, or the parsed
    dict: the kind its ``architectures`` names, else the default (the first), whose reader refuses
    what is not a draft of its kind."""
    if isinstance(source, Mapping):
        d, where = source, where or "draft config.json"
    else:
        p = os.fspath(source)
        where = os.path.join(p, "config.json") if os.path.isdir(p) else p
        if not os.path.isfile(where):
            raise ConfigError(f"no config.json at {where}; point at a draft directory")
        with open(where) as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(d).__name__}")
    kind = for_architectures(d.get("architectures")) or KINDS[0]
    return kind.config.from_hf_dict(d, where)
