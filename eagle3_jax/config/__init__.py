"""Frozen configuration dataclasses, read from Hugging Face ``config.json`` files and YAML.

One module a kind: ``target`` (TargetConfig, RopeConfig), ``mesh`` (MeshConfig), ``common`` (YAML
mappings, dtype names). Import them from here; a draft's config belongs to its kind
(``eagle3_jax.drafts``).
"""

from eagle3_jax.config.common import DTYPES, read_yaml_mapping, resolve_dtype
from eagle3_jax.config.mesh import MESH_AXES, MeshConfig
from eagle3_jax.config.target import (NESTED_TEXT_MODEL_TYPES, TARGET_ARCHITECTURES, TARGET_MODEL_TYPES, RopeConfig,
                                      TargetConfig)

__all__ = ["DTYPES", "MESH_AXES", "NESTED_TEXT_MODEL_TYPES", "TARGET_ARCHITECTURES", "TARGET_MODEL_TYPES",
           "MeshConfig", "RopeConfig", "TargetConfig", "read_yaml_mapping", "resolve_dtype"]
