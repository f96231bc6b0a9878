"""Train an EAGLE-3 draft for a target (training-time test), or a P-EAGLE one (``draft_kind: peagle``)
or a DFlash one (``draft_kind: dflash``), and export it in the SpecForge layout.

    python train.py --config configs/train/NAME.yaml [key=value ...]

``key=value`` overrides any config key (``draft.intermediate_size=4096``, ``mode=prepare``).
A rerun of the same command resumes from the last checkpoint in ``out_dir``.

Multi-host: run the same command on every host with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or the EAGLE3_* environment); the mesh spans all hosts' devices, each process
loads its share of every batch, process 0 writes the logs, vocab map and export, and all of them
write the checkpoints together, so ``out_dir`` must be on a filesystem every host shares.

Exit status: 0 done, 2 a bad command line or config (nothing ran), 1 the run failed.
"""

import argparse
import logging
import sys

USAGE = """usage: python train.py --config configs/train/NAME.yaml [key=value ...]

Trains an EAGLE-3 draft (or draft_kind: peagle / dflash); the YAML config names the target, the data and out_dir (see configs/train/,
e.g. configs/train/demo.yaml). `python train.py --help` lists every config key and the data formats."""


def build_parser() -> argparse.ArgumentParser:
    from eagle3_jax import distributed, settings_io
    from eagle3_jax.train.config import DATA_FORMATS, HOW_TO_MAKE_DATA, TrainConfig

    epilog = (f"config keys (YAML or key=value; defaults shown):\n{settings_io.describe_defaults(TrainConfig)}\n\n"
              f"data (the `data` file):\n{DATA_FORMATS}\n{HOW_TO_MAKE_DATA}.")
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML training config (see configs/train/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of config keys")
    parser.add_argument("--no-progress", action="store_true",
                        help="plain log lines every log_every steps instead of a progress bar (the bar is drawn "
                             "only when stderr is a terminal)")
    distributed.add_flags(parser)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("eagle3_jax").setLevel(logging.INFO)  # ours; the libraries' chatter stays quiet

    from eagle3_jax import backends, distributed
    from eagle3_jax.errors import Eagle3Error
    from eagle3_jax.train import TrainConfig, check_setup, run

    try:
        # Before anything touches JAX's devices: the trainer's mesh spans every process's devices.
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        cfg = TrainConfig.load(args.config, args.overrides)
        plan = check_setup(cfg)
    except Eagle3Error as e:   # the command line, the config or the pair they name: nothing has run
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    import jax

    log = logging.getLogger("eagle3_jax")
    for name, value in (("dtype", cfg.dtype), ("target_dtype", cfg.target_dtype)):   # float32 is the default
        note = value and backends.half_on_cpu_note(value, jax.default_backend())
        if note and distributed.is_writer():
            log.warning("%s=%s: %s", name, value, note)
    # A bar redraws with carriage returns: on a log file or a pipe, plain lines every log_every steps.
    bar = not args.no_progress and sys.stderr.isatty() and distributed.is_writer()
    try:
        result = run(cfg, progress=bar, plan=plan)
    except Eagle3Error as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)
    if distributed.is_writer():
        print(f"hidden states written to {result}" if cfg.mode == "prepare" else
              f"trained to step {result.step}; draft exported to {result.export_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
