"""Draft training CLI (EAGLE-3 with training-time test).

Not built yet: this prints what exists today instead of pretending to train.
"""

import sys

USAGE = """\
train.py: EAGLE-3 draft training (training-time test, online/offline hidden states, orbax
checkpoints, SpecForge export) is not built yet. Drafts trained elsewhere (SpecForge layout) load
with eagle3_jax.load_draft(path, target=...), and eagle3_jax.save_draft writes that layout.
"""


def main(argv=None) -> int:
    print(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
