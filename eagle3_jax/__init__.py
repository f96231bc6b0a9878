"""eagle3-jax: EAGLE-3 speculative decoding for DeepSeek-V3-class MoE models in JAX."""

from eagle3_jax import backends as _backends

_backends.quiet_without_tpu()   # before any JAX backend starts: no libtpu start-up errors without a TPU

from eagle3_jax.api import (DraftOutput, ForwardOutput, GenerationResult, Generator, LoadedDraft, LoadedTarget,
                            build_draft, build_target, load_draft, load_target, save_draft)
from eagle3_jax.config import MeshConfig, RopeConfig, TargetConfig
from eagle3_jax.drafts import DraftConfig
from eagle3_jax.metrics import AcceptanceCollapseWarning, GenerationStats
from eagle3_jax.errors import CheckpointError, ConfigError, Eagle3Error
from eagle3_jax.sharding import make_mesh
from eagle3_jax.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = [
    "AcceptanceCollapseWarning", "DraftConfig", "DraftOutput", "GenerationResult", "GenerationStats", "Generator",
    "LoadedDraft", "build_draft", "load_draft", "save_draft",
    "CheckpointError", "ConfigError", "Eagle3Error", "ForwardOutput", "LoadedTarget", "MeshConfig",
    "RopeConfig", "TargetConfig", "build_target", "load_target", "make_mesh",
    "Tokenizer", "TokenizerError", "load_tokenizer",
]
