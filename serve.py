"""Crash-safe batch generation with a target and an optional EAGLE-3 draft (see eagle3_jax/serve/).

    python serve.py --target DIR [--draft DIR] --input prompts.jsonl --output out.jsonl [options]

With no arguments it runs the embedded demo in demo/ (target-only vs EAGLE-3). `python serve.py --help`
lists the options.
"""

import os
import sys

from eagle3_jax.serve.cli import main

if __name__ == "__main__":
    sys.exit(main(demo_dir=os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")))
