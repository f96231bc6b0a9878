"""``MeshConfig``: the (data, expert, tensor) device mesh, parsed from ``data=1,expert=8,tensor=1``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from eagle3_jax.errors import ConfigError


MESH_AXES = ("data", "expert", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    expert: int = 1
    tensor: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.expert, self.tensor)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def parse(cls, spec: "str | Mapping[str, int] | MeshConfig | None") -> "MeshConfig":
        """Parses ``data=1,expert=8,tensor=1`` (any subset; missing axes are 1)."""
        if spec is None:
            return cls()
        if isinstance(spec, MeshConfig):
            return spec
        if isinstance(spec, Mapping):
            items = dict(spec)
        else:
            items = {}
            for part in str(spec).split(","):
                part = part.strip()
                if not part:
                    continue
                if "=" not in part:
                    raise ConfigError(
                        f"mesh spec '{spec}': part '{part}' is not axis=size; write e.g. data=1,expert=8,tensor=1"
                    )
                k, v = part.split("=", 1)
                items[k.strip()] = v.strip()
        out = {}
        for k, v in items.items():
            if k not in MESH_AXES:
                raise ConfigError(f"mesh spec '{spec}': unknown axis '{k}'; axes are {', '.join(MESH_AXES)}")
            try:
                n = int(v)
            except (TypeError, ValueError):
                raise ConfigError(f"mesh spec '{spec}': size of '{k}' must be an integer, found '{v}'") from None
            if n <= 0:
                raise ConfigError(f"mesh spec '{spec}': size of '{k}' must be positive, found {n}")
            out[k] = n
        return cls(**out)
