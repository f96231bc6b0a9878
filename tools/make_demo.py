"""Build the demo models from scratch: `python tools/make_demo.py [--stages 1,2,3,4,5,6] [--out demo]`.

Stages (each reads what the earlier ones left in --out and --work, so any suffix can be rerun):
  1 corpus     the running interpreter's standard library *.py files, split train / held-out by a
               hash of each path; file lists in OUT/corpus.json, held-out prompts in OUT/prompts.jsonl
  2 tokenizer  byte-level BPE (tokenizers), OUT/target/tokenizer.json + tokenizer_config.json;
               the corpus as token streams in WORK
  3 target     a DeepseekV3-architecture MoE pre-trained on the train stream (optax AdamW) for a step
               budget (--max-steps); log in OUT/train_log.jsonl, best parameters in WORK. Resumable:
               the full training state is saved to WORK/target_state.npz every few minutes, and
               rerunning `--stages 3` with the same settings continues from it (other settings are
               refused; delete that file to start over)
  4 regenerate `serve.py --emit training`: the target's continuations of train-file prompts
  5 draft      `train.py --config configs/train/demo.yaml` on that data, then the P-EAGLE draft
               (`configs/train/peagle_demo.yaml`) to OUT/peagle and the DFlash draft
               (`configs/train/demo_dflash.yaml`) to OUT/dflash; `--drafts` picks some of them
  6 export     the target in Hugging Face layout (bf16) to OUT/target, checked against transformers;
               the drafts (when stage 5 has run) checked through the public loaders; OUT/README.md
Stage 6's target export runs before stage 4 when both are asked for, since stage 4 serves it.

Everything is seeded (--seed). Intermediate files go to --work (default build/demo_work, ignored by git).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tools.demo import bpe, corpus, lm, lm_state  # noqa: E402

DEMO_TRAIN_CONFIG = "configs/train/demo.yaml"
PEAGLE_TRAIN_CONFIG = "configs/train/peagle_demo.yaml"
DFLASH_TRAIN_CONFIG = "configs/train/demo_dflash.yaml"
# The demo's drafts: its folder under --out (and its name for --drafts), recipe, run folder under --work.
DEMO_DRAFTS = (("draft", DEMO_TRAIN_CONFIG, "draft_run"), ("peagle", PEAGLE_TRAIN_CONFIG, "peagle_run"),
               ("dflash", DFLASH_TRAIN_CONFIG, "dflash_run"))
DRAFTS = tuple(folder for folder, _, _ in DEMO_DRAFTS)
STAGE_NAMES = {1: "corpus", 2: "tokenizer", 3: "target", 4: "regenerate", 5: "draft", 6: "export"}


def say(msg: str) -> None:
    print(msg, flush=True)


class Paths:
    def __init__(self, out: str, work: str):
        self.out, self.work = out, work
        self.corpus_json = os.path.join(out, "corpus.json")
        self.prompts = os.path.join(out, "prompts.jsonl")
        self.target = os.path.join(out, "target")
        self.draft = os.path.join(out, "draft")
        self.train_log = os.path.join(out, "train_log.jsonl")
        self.readme = os.path.join(out, "README.md")
        self.regen_prompts = os.path.join(work, "regen_prompts.jsonl")
        self.train_tokens = os.path.join(work, "train_tokens.npy")
        self.heldout_tokens = os.path.join(work, "heldout_tokens.npy")
        self.target_params = os.path.join(work, "target_params.npz")
        self.target_state = os.path.join(work, "target_state.npz")
        self.regenerated = os.path.join(work, "regenerated.jsonl")
        self.draft_run = os.path.join(work, "draft_run")
        self.peagle = os.path.join(out, "peagle")
        self.peagle_run = os.path.join(work, "peagle_run")
        self.dflash = os.path.join(out, "dflash")
        self.dflash_run = os.path.join(work, "dflash_run")
        self.summary = os.path.join(work, "summary.json")


def load_summary(p: Paths) -> dict:
    if os.path.isfile(p.summary):
        with open(p.summary) as f:
            return json.load(f)
    return {}


def update_summary(p: Paths, key: str, value) -> None:
    from eagle3_jax.checkpoint.staging import atomic_file

    s = load_summary(p)
    s[key] = value
    with atomic_file(p.summary) as f:
        json.dump(s, f, indent=2, default=str)


def require(path: str, stage: int) -> None:
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} is missing; run stage {stage} ({STAGE_NAMES[stage]}) first")


def corpus_files(p: Paths):
    """The corpus split, checked against the manifest stage 1 wrote (same interpreter, same files)."""
    require(p.corpus_json, 1)
    with open(p.corpus_json) as f:
        manifest = json.load(f)
    train, heldout, _ = corpus.build(manifest["stdlib"])
    for name, files in (("train", train), ("heldout", heldout)):
        if corpus.digest(files) != manifest[name]["sha256"]:
            raise SystemExit(f"error: the {name} files under {manifest['stdlib']} differ from {p.corpus_json}; "
                             "rerun stage 1")
    return train, heldout


# ====================================================================== stages
def stage_corpus(p: Paths, args) -> None:
    root = corpus.stdlib_root()
    train, heldout, counts = corpus.build(root)
    manifest = corpus.manifest(root, train, heldout, counts)
    with open(p.corpus_json, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    heldout_prompts = corpus.spread_prompts(heldout, args.heldout_prompts, "heldout", per_file=3)
    regen_prompts = corpus.spread_prompts(train, args.regen_prompts, "train", per_file=4)
    corpus.write_jsonl(p.prompts, [{"id": r["id"], "prompt": r["prompt"]} for r in heldout_prompts])
    corpus.write_jsonl(p.regen_prompts, [{"id": r["id"], "prompt": r["prompt"]} for r in regen_prompts])
    tr, ho = manifest["train"], manifest["heldout"]
    say(f"corpus: {tr['files']} train files ({tr['bytes'] / 1e6:.1f} MB, of which {tr['test_files']} test modules "
        f"{tr['test_bytes'] / 1e6:.1f} MB), {ho['files']} held-out library files ({ho['bytes'] / 1e3:.0f} kB) "
        f"from the modules {', '.join(manifest['heldout_modules'])}; from {root}")
    say("corpus counts: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    say(f"prompts: {len(heldout_prompts)} held-out -> {p.prompts}, {len(regen_prompts)} train -> {p.regen_prompts}")
    update_summary(p, "corpus", {k: manifest[k] for k in ("source", "rules", "counts", "train", "heldout",
                                                          "heldout_modules")})


def stage_tokenizer(p: Paths, args) -> None:
    import numpy as np

    train, heldout = corpus_files(p)
    t = time.perf_counter()
    tok = bpe.train_tokenizer((f.text for f in train), args.vocab_size)
    bpe.save(tok, p.target, model_max_length=args.seq_len)
    streams = {}
    for name, files, path in (("train", train, p.train_tokens), ("heldout", heldout, p.heldout_tokens)):
        ids = bpe.encode_documents(tok, [f.text for f in files])
        np.save(path, ids)
        streams[name] = int(len(ids))
    nbytes = sum(len(f.text.encode()) for f in train)
    say(f"tokenizer: vocab {tok.get_vocab_size()} in {time.perf_counter() - t:.0f}s; train {streams['train']:,} "
        f"tokens ({nbytes / streams['train']:.2f} bytes/token), held-out {streams['heldout']:,}")
    update_summary(p, "tokenizer", {"vocab_size": tok.get_vocab_size(), "tokens": streams,
                                    "bytes_per_token": round(nbytes / streams["train"], 3)})


def stage_target(p: Paths, args) -> None:
    import numpy as np

    require(p.train_tokens, 2)
    tok = bpe.load(p.target)
    hf_config = lm.target_hf_config(tok.get_vocab_size(), tok.token_to_id(bpe.BOS), tok.token_to_id(bpe.EOS),
                                    max_positions=args.seq_len)
    settings = lm.TrainSettings(seq_len=args.seq_len, batch_size=args.batch_size, peak_lr=args.lr,
                                max_steps=args.max_steps, max_seconds=args.max_minutes * 60, seed=args.seed,
                                eval_every_steps=args.eval_every_steps, moe_kernel=args.moe_kernel,
                                checkpoint_every_seconds=args.checkpoint_every_seconds)
    summary = lm.train(hf_config, np.load(p.train_tokens), np.load(p.heldout_tokens), settings,
                       p.train_log, p.target_params, p.target_state, say=say)
    say(f"target: {summary['steps']} steps, {summary['tokens'] / 1e6:.1f}M tokens, best held-out loss "
        f"{summary['best_heldout_loss']:.3f} at step {summary['best_step']} ({summary['stop_reason']}), "
        f"{summary['wall_s'] / 60:.1f} min of training over {summary['sessions']} session(s)")
    update_summary(p, "target", summary)
    if summary["stop_reason"] == "interrupted":
        raise SystemExit(f"target training was interrupted at step {summary['steps']}; rerun `--stages 3` "
                         "with the same settings to continue")


def stage_export_target(p: Paths, args) -> None:
    from tools.demo import export

    require(p.target_params, 3)
    flat, meta = lm_state.load_params(p.target_params)
    files = export.export_target(meta["config"], flat, p.target, p.target)
    say(f"exported target (step {meta['step']}, held-out loss {meta['heldout_loss']:.3f}) to {p.target}: "
        + ", ".join(files))
    with open(p.prompts) as f:
        prompt = json.loads(f.readline())["prompt"]
    check = export.verify(p.target, prompt, args.verify_tokens, say=say)
    if not check["ok"]:
        raise SystemExit("error: transformers' DeepseekV3ForCausalLM and eagle3_jax.load_target disagree on the "
                         "exported target (see above); the parameters are kept in " + p.target_params)
    update_summary(p, "export_target", {"step": meta["step"], "heldout_loss": meta["heldout_loss"],
                                        "files": files, "sample": {k: check[k] for k in (
                                            "prompt", "continuation", "tokens", "transformers_match",
                                            "max_logit_diff")}})


def stage_regenerate(p: Paths, args) -> None:
    from tools.demo import draft

    require(p.regen_prompts, 1)
    draft.regenerate(p.target, p.regen_prompts, p.regenerated, args.regen_new_tokens, args.regen_batch_size,
                     max_len=args.seq_len, temperatures=args.regen_temperatures, say=say)
    update_summary(p, "regenerate", {"prompts": sum(1 for _ in open(p.regen_prompts)),
                                     "new_tokens": args.regen_new_tokens,
                                     "temperatures": list(args.regen_temperatures)})


def stage_draft(p: Paths, args) -> None:
    from tools.demo import draft

    require(p.regenerated, 4)
    for folder, recipe, run in DEMO_DRAFTS:
        if folder in args.drafts:
            export_dir = os.path.join(p.out, folder)
            draft.train_draft(recipe, p.target, p.regenerated, os.path.join(p.work, run), export_dir, say=say)
            update_summary(p, folder, {"config": recipe, "export_dir": export_dir})


def stage_export_draft(p: Paths, args) -> None:
    """The draft is exported by train.py itself; here it is loaded through the public loaders, its
    held-out acceptance length measured at the shipped K, and demo/demo.yaml written for the demo."""
    if not os.path.isfile(os.path.join(p.draft, "config.json")):
        say(f"draft: none at {p.draft} yet (stages 4-5); the README lists it as pending")
        return
    import yaml

    from eagle3_jax.serve import demo
    from tools.demo import draft

    has_peagle = os.path.isfile(os.path.join(p.peagle, "config.json"))
    has_dflash = os.path.isfile(os.path.join(p.dflash, "config.json"))
    settings = demo.DemoSettings(num_draft_tokens=args.num_draft_tokens,
                                 parallel_draft_tokens=args.parallel_k if has_peagle else 0,
                                 dflash_draft_tokens=args.dflash_k if has_dflash else 0)
    with open(os.path.join(p.out, "demo.yaml"), "w") as f:
        f.write("# What `python serve.py` (no arguments) runs; written by tools/make_demo.py stage 6.\n")
        # tuples as YAML lists (safe_dump has no tuple)
        yaml.safe_dump({k: list(v) if isinstance(v, tuple) else v for k, v in settings.__dict__.items()}, f,
                       sort_keys=False)
    if "draft" in args.drafts:   # the chain draft
        heldout = draft.heldout_acceptance(p.out, args.heldout_k)
        say(f"draft at {p.draft}: held-out tau at K={args.heldout_k} by temperature "
            f"{ {t: v['tau'] for t, v in heldout['by_temperature'].items()} } over "
            f"{heldout['prompts']} prompts; per position {heldout['accept_rate_per_position']}")
        update_summary(p, "draft_heldout", heldout)
        update_summary(p, "draft_training", draft.training_summary(p.draft_run))
        with open(os.path.join(REPO, DEMO_TRAIN_CONFIG)) as f:
            update_summary(p, "draft_config", yaml.safe_load(f))
    # (summary key, label, directory, K, run directory, recipe) of each one-pass draft
    for key, label, where, k, run, recipe in (
            ("peagle", "P-EAGLE", p.peagle, args.parallel_k, p.peagle_run, PEAGLE_TRAIN_CONFIG),
            ("dflash", "DFlash", p.dflash, args.dflash_k, p.dflash_run, DFLASH_TRAIN_CONFIG)):
        if key not in args.drafts or not os.path.isfile(os.path.join(where, "config.json")):
            continue
        heldout = draft.heldout_acceptance(p.out, k, one_pass=label)
        say(f"{label} draft at {where}: held-out tau at K={k} by temperature "
            f"{ {t: v['tau'] for t, v in heldout['by_temperature'].items()} }")
        update_summary(p, f"{key}_heldout", heldout)
        update_summary(p, f"{key}_training", draft.training_summary(run))
        with open(os.path.join(REPO, recipe)) as f:
            update_summary(p, f"{key}_config", yaml.safe_load(f))


# ====================================================================== README
def dir_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def write_readme(p: Paths, args) -> None:
    from tools.demo import readme

    old = open(p.readme).read() if os.path.isfile(p.readme) else None
    text = readme.render(load_summary(p), out=p.out, demo_bytes=dir_size(p.out), old_text=old)
    with open(p.readme, "w") as f:
        f.write(text)
    say(f"wrote {p.readme}; {p.out}/ is {dir_size(p.out) / 1e6:.1f} MB")


# ====================================================================== main
def draft_tokens(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a whole number, got '{text}'") from None


def draft_list(text: str) -> tuple[str, ...]:
    names = tuple(d.strip() for d in text.split(",") if d.strip())
    if not names or any(d not in DRAFTS for d in names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(DRAFTS)} separated by commas, got '{text}'")
    return names


def temperature_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    if not values or any(t < 0 for t in values):
        raise argparse.ArgumentTypeError(f"expected temperatures >= 0 separated by commas (e.g. 0,0.7,1), got '{text}'")
    return values


def parse_stages(text: str) -> list[int]:
    try:
        stages = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"error: --stages expects numbers 1-6 separated by commas, got '{text}'")
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad or not stages:
        raise SystemExit(f"error: --stages: unknown stage(s) {bad or text}; stages are "
                         + ", ".join(f"{k} {v}" for k, v in STAGE_NAMES.items()))
    return stages


def main(argv=None) -> int:
    lm_defaults = lm.TrainSettings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="1,2,3,4,5,6", help="comma-separated stages to run (default all)")
    ap.add_argument("--out", default="demo", help="output folder (default demo)")
    ap.add_argument("--work", default="build/demo_work", help="intermediate files (default build/demo_work)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=lm_defaults.max_steps,
                    help="stage 3's step budget; the learning-rate schedule is defined over it")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="optional wall-time budget of stage 3 (0: none); when set, the schedule follows "
                         "whichever of steps and time runs out first, so the result depends on the machine")
    ap.add_argument("--eval-every-steps", type=int, default=lm_defaults.eval_every_steps,
                    help="held-out evaluation (and state save) interval of stage 3")
    ap.add_argument("--checkpoint-every-seconds", type=float, default=lm_defaults.checkpoint_every_seconds,
                    help="stage 3 also saves its resumable state this often")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--moe-kernel", default="padded_blocks", choices=["padded_blocks", "ragged"],
                    help="differentiable routed-expert kernel for stage 3 (same results; padded_blocks is "
                         "faster on CPU)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of stage 3")
    ap.add_argument("--heldout-prompts", type=int, default=32)
    ap.add_argument("--regen-prompts", type=int, default=2000)
    ap.add_argument("--regen-new-tokens", type=int, default=96)
    ap.add_argument("--regen-batch-size", type=int, default=64)
    ap.add_argument("--regen-temperatures", type=temperature_list, default=(0.0, 0.7, 1.0),
                    help="stage 4 deals the prompts round-robin over these sampling temperatures (0: greedy), "
                         "so the draft also learns sampled text")
    ap.add_argument("--num-draft-tokens", type=draft_tokens, default="auto",
                    help="demo/demo.yaml's num_draft_tokens: auto (default) or a fixed K")
    ap.add_argument("--heldout-k", type=int, default=6,
                    help="the fixed K at which stage 6 measures held-out acceptance (greedy and T=1)")
    ap.add_argument("--parallel-k", type=int, default=4,
                    help="the P-EAGLE draft's fixed K in demo.yaml, and where stage 6 measures its acceptance")
    ap.add_argument("--dflash-k", type=int, default=4,
                    help="the DFlash draft's fixed K in demo.yaml, and where stage 6 measures its acceptance")
    ap.add_argument("--drafts", type=draft_list, default=DRAFTS,
                    help=f"the drafts stages 5 and 6 train and measure (default all: {','.join(DRAFTS)})")
    ap.add_argument("--verify-tokens", type=int, default=48, help="greedy tokens compared with transformers")
    args = ap.parse_args(argv)
    stages = parse_stages(args.stages)

    p = Paths(args.out, args.work)
    os.makedirs(p.out, exist_ok=True)
    os.makedirs(p.work, exist_ok=True)

    from tools.demo.draft import StageUnavailable

    plan = []
    for s in stages:
        if s == 6:
            continue
        if s == 4 and 6 in stages:
            plan.append(("6 export (target)", stage_export_target))
        plan.append((f"{s} {STAGE_NAMES[s]}", {1: stage_corpus, 2: stage_tokenizer, 3: stage_target,
                                               4: stage_regenerate, 5: stage_draft}[s]))
    if 6 in stages:
        if 4 not in stages:
            plan.append(("6 export (target)", stage_export_target))
        plan.append(("6 export (draft)", stage_export_draft))
    t_all = time.perf_counter()
    status = 0
    for name, fn in plan:
        t = time.perf_counter()
        say(f"== stage {name}")
        try:
            fn(p, args)
        except StageUnavailable as e:
            say(f"stage {name} cannot run yet: {e}")
            status = 3
            break
        say(f"== stage {name} done in {time.perf_counter() - t:.0f}s")
    if 6 in stages or status:
        write_readme(p, args)
    say(f"total {(time.perf_counter() - t_all) / 60:.1f} min")
    return status


if __name__ == "__main__":
    sys.exit(main())
