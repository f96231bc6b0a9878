"""Train an EAGLE-3 draft for a target (training-time test) and export it in the SpecForge layout.

    python train.py --config configs/train/NAME.yaml [key=value ...]

``key=value`` overrides any config key (``draft.intermediate_size=4096``, ``mode=prepare``).
A rerun of the same command resumes from the last checkpoint in ``out_dir``.

Multi-host: run the same command on every host with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or the EAGLE3_* environment); the mesh spans all hosts' devices, each process
loads its share of every batch, process 0 writes the logs, vocab map and export, and all of them
write the checkpoints together, so ``out_dir`` must be on a filesystem every host shares.
"""

import argparse
import logging
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML training config (see configs/train/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of config keys")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from eagle3_jax import distributed

    distributed.add_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("eagle3_jax").setLevel(logging.INFO)  # ours; the libraries' chatter stays quiet

    from eagle3_jax.errors import Eagle3Error
    from eagle3_jax.train import TrainConfig, run

    try:
        # Before anything touches JAX's devices: the trainer's mesh spans every process's devices.
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        cfg = TrainConfig.load(args.config, args.overrides)
        result = run(cfg, progress=not args.no_progress and distributed.is_writer())
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if distributed.is_writer():
        print(f"hidden states written to {result}" if cfg.mode == "prepare" else
              f"trained to step {result.step}; draft exported to {result.export_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
