"""Crash-safe batch generation with a target and an optional EAGLE-3 draft (see eagle3_jax/serve/).

    python serve.py --target DIR [--draft DIR] --input prompts.jsonl --output out.jsonl [options]

With no arguments it runs the embedded demo in demo/ (target-only vs EAGLE-3). `python serve.py --help`
lists the options.
"""

import os
import sys

from eagle3_jax import compile_cache
from eagle3_jax.serve.cli import main

if __name__ == "__main__":
    # compiled programs persist on disk (EAGLE3_JAX_COMPILE_CACHE=off leaves JAX's settings alone):
    # a later run of the same pair and shapes starts in seconds instead of compiling again
    compile_cache.enable()
    sys.exit(main(demo_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")))
