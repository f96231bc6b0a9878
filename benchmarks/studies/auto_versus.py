"""The K chooser of ``num_draft_tokens="auto"`` against the one of an earlier commit, side by side.

Adds a mode "auto@COMMIT" to ``benchmarks/speedup.py``: the same Generator, its session's policy
replaced by the chooser that ``eagle3_jax/speculative/autodraft.py`` held at COMMIT (read with
``git show``), probing its round costs with that commit's probe. Both choosers then run in one
process, interleaved with target-only and the fixed Ks, so their ratios share the machine's load.
The earlier chooser sees what the Engine hands any policy and ignores what it does not know of.

    .venv/bin/python benchmarks/studies/auto_versus.py --against 27694ba \
        --prompts demo,thirdparty --batch 1,8 --temperature 0,1 --k 2 --num-prompts 8 \
        --max-new-tokens 64 --repeats 3 --parallel-draft none [--json OUT.json]

Every other flag is speedup.py's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import eagle3_jax as e3  # noqa: E402
import speedup  # noqa: E402
from eagle3_jax.speculative.autodraft import AutoDraft  # noqa: E402
from eagle3_jax.speculative.session import probe_costs as session_probe_costs  # noqa: E402


def load_chooser(commit: str):
    """The autodraft module as it was at ``commit``, imported under another name."""
    src = subprocess.run(["git", "show", f"{commit}:eagle3_jax/speculative/autodraft.py"], cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"autodraft_{commit}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"autodraft_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def earlier_mode(old, max_draft_tokens: int = 6):
    params = inspect.signature(old.AutoDraft.next_k).parameters   # what that commit's next_k takes

    class Earlier(old.AutoDraft, AutoDraft):   # an AutoDraft to the Engine, the old one's methods first
        def next_k(self, drafted_rows=True, all_new=False, wave=None):
            if "wave" in params:   # a chooser that prices the last wave
                return old.AutoDraft.next_k(self, drafted_rows, all_new, wave)
            if "all_new" in params:
                return old.AutoDraft.next_k(self, drafted_rows, all_new)
            return old.AutoDraft.next_k(self, drafted_rows)

        def rows_finished(self, *rows):
            if hasattr(old.AutoDraft, "rows_finished"):
                old.AutoDraft.rows_finished(self, *rows)

    def make(pair, batch, capacity):
        gen = e3.Generator(pair.target, pair.draft, num_draft_tokens="auto", max_len=capacity, batch_size=batch,
                           max_draft_tokens=max_draft_tokens)
        session, policies = gen.session, {}

        def policy(program, sp, sampling):
            key = (dataclasses.replace(program, max_new_tokens=0), sampling.greedy, sampling.temperature)
            if key not in policies:
                # the probe moved from autodraft into the session; either way its own commit's
                probe = getattr(old, "probe_costs", None) or session_probe_costs
                costs = probe(session, program, sp, sorted({0, 1, max_draft_tokens}))
                policies[key] = Earlier(costs, max_draft_tokens, old.Acceptance(max_draft_tokens))
            return policies[key]

        session.policy = policy
        return gen

    return make


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--against" not in argv:
        raise SystemExit("usage: auto_versus.py --against COMMIT [speedup.py flags]")
    i = argv.index("--against")
    commit = argv[i + 1]
    del argv[i:i + 2]
    return speedup.main(argv, extra_modes={f"auto@{commit}": earlier_mode(load_chooser(commit))})


if __name__ == "__main__":
    sys.exit(main())
