"""eagle3-jax: EAGLE-3 speculative decoding for DeepSeek-V3-class MoE models in JAX."""

from eagle3_jax.api import ForwardOutput, LoadedTarget, build_target, load_target
from eagle3_jax.config import MeshConfig, RopeConfig, TargetConfig
from eagle3_jax.errors import CheckpointError, ConfigError, Eagle3Error
from eagle3_jax.sharding import make_mesh

__all__ = [
    "CheckpointError", "ConfigError", "Eagle3Error", "ForwardOutput", "LoadedTarget", "MeshConfig",
    "RopeConfig", "TargetConfig", "build_target", "load_target", "make_mesh",
]
