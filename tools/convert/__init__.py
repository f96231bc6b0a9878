"""``python -m tools.convert``: Hugging Face safetensors <-> eagle3-jax (orbax) checkpoints.

See ``tools/convert/core.py`` for what is kept, dropped and dequantized, and ``__main__.py`` for
the command line.
"""

from tools.convert.core import to_hf, to_jax
from tools.convert.inspect import inspect

__all__ = ["inspect", "to_hf", "to_jax"]
