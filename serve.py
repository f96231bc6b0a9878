"""Crash-safe batch generation with a target and an optional EAGLE-3 draft (see eagle3_jax/serve/).

    python serve.py --target DIR [--draft DIR] --input prompts.jsonl --output out.jsonl [options]

Without --target it prints how to point it at a model. `python serve.py --help` lists the options.
"""

import sys

from eagle3_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
