"""Rebuilds tests/data/trained_draft: the tiny draft the loop tests speculate with.

It is trained on the tiny parity target's own greedy outputs (tests/spec_fixtures.py), which
transformers rebuilds bit-identically from a fixed seed, so the suite ships the result instead of
training it at the start of every run. Rerun after changing the tiny target or the draft's shapes:

    .venv/bin/python -m tests.data.build_trained_draft
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "trained_draft"


def main() -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import eagle3_jax as e3
    from tests import hf_fixtures, spec_fixtures

    with tempfile.TemporaryDirectory() as tmp:
        name, overrides = next(iter(hf_fixtures.PARITY_CONFIGS.items()))   # the suite's tiny target
        target_dir, _ = hf_fixtures.save_random_target(Path(tmp) / name, overrides, seed=0)
        target = e3.load_target(target_dir)
        draft = e3.build_draft(spec_fixtures.tiny_draft_config(target.config), target, seed=0)
        trained, loss = spec_fixtures.train_draft_on_target(target, draft, spec_fixtures.target_greedy_corpus(target))
        staged = Path(tmp) / "draft"
        e3.save_draft(trained, staged)
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(staged, OUT)
    print(f"wrote {OUT} (final training loss {loss:.4f})")


if __name__ == "__main__":
    main()
