"""demo/README.md from the run's summary: recipe, seeds, losses, and what is still pending."""

from __future__ import annotations

import datetime
import platform

from tools.demo.lm import TARGET_SHAPE


def _fmt(x, nd=3):
    return "n/a" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


KEPT_START, KEPT_END = "<!-- kept: measured outside make_demo; a rebuild keeps it -->", "<!-- /kept -->"


def kept_block(old_text: str | None) -> list[str]:
    """The block between the KEPT markers of the previous README (comparisons run by hand, such as
    the training objectives), carried into the rebuilt one; [] when there is none."""
    if not old_text or KEPT_START not in old_text or KEPT_END not in old_text:
        return []
    start = old_text.index(KEPT_START)
    return old_text[start:old_text.index(KEPT_END, start) + len(KEPT_END)].splitlines() + [""]


def render(s: dict, out: str, demo_bytes: int, old_text: str | None = None) -> str:
    c, tk, tg, ex = s.get("corpus", {}), s.get("tokenizer", {}), s.get("target", {}), s.get("export_target", {})
    st = tg.get("settings", {})
    shape = tg.get("config", TARGET_SHAPE)
    lines = [
        "# The demo models",
        "",
        "Built from scratch by `python tools/make_demo.py` (stages 1-6; see its docstring), on "
        f"{platform.machine()} / Python {platform.python_version()}, {datetime.date.today().isoformat()}.",
        "No downloads: the corpus is the Python standard library of the interpreter that runs the script.",
        "",
        "| path | what |",
        "| --- | --- |",
        "| `target/` | DeepseekV3ForCausalLM (Hugging Face layout, bf16; router correction bias fp32) + tokenizer |",
        "| `draft/` | EAGLE-3 draft (SpecForge layout) — "
        + ("present" if s.get("draft") else "**pending** (stages 4-5)") + " |",
        *(f"| `{sub}/` | {what} — present |" for key, sub, what in (
            ("peagle", "peagle", "P-EAGLE draft (SpecForge `PEagleDraftModel` layout)"),
            ("dflash", "dflash", "DFlash draft (SpecForge `DFlashDraftModel` layout)")) if s.get(key)),
        "| `prompts.jsonl` | held-out prompts (from files the target never saw) |",
        "| `corpus.json` | the train / held-out file lists with content hashes |",
        "| `train_log.jsonl` | the target's pre-training log (train and held-out loss) |",
        "",
        "## Recipe",
        "",
    ]
    if c:
        r, n = c.get("rules", {}), c.get("counts", {})
        lines += [
            f"1. **Corpus** — {c.get('source')}: {c['train']['files']} train files "
            f"({c['train']['bytes'] / 1e6:.1f} MB, of which {c['train'].get('test_files')} test modules, "
            f"{c['train'].get('test_bytes', 0) / 1e6:.1f} MB), {c['heldout']['files']} held-out library files "
            f"({c['heldout']['bytes'] / 1e3:.0f} kB) of the modules {', '.join(c.get('heldout_modules', []))}. "
            f"Test modules: {r.get('test_files')}. Left out: {r.get('skip_files')}. Deduplicated: {r.get('dedupe')} "
            f"({n.get('exact_duplicates')} exact, {n.get('near_duplicates')} near). Held out: {r.get('heldout')} "
            f"({n.get('heldout_module_tests_left_out')} test files).",
        ]
    if tk:
        lines += [
            f"2. **Tokenizer** — byte-level BPE (`tokenizers`), vocab {tk['vocab_size']} including `<|bos|>` (0) and "
            f"`<|eos|>` (1), trained on the train files; {tk['bytes_per_token']} bytes/token. Each file is one "
            f"document: `<|bos|>` text `<|eos|>` ({tk['tokens']['train']:,} train tokens, "
            f"{tk['tokens']['heldout']:,} held-out). The chat template only concatenates message contents, so "
            "`{\"messages\": [prompt, continuation]}` means the plain text prompt + continuation.",
        ]
    if tg:
        lines += [
            f"3. **Target** — DeepSeek-V3 architecture, {tg['params'] / 1e6:.2f}M parameters "
            f"({tg['active_params'] / 1e6:.2f}M active per token): see `target/config.json` ({shape['num_hidden_layers']} "
            f"layers at hidden {shape['hidden_size']}, MLA with q LoRA, dense first layer, {shape['n_routed_experts']} "
            f"routed experts top-{shape['num_experts_per_tok']} in {shape['n_group']} groups keep "
            f"{shape['topk_group']}, {shape['n_shared_experts']} shared expert, sigmoid router with "
            "`e_score_correction_bias`). Trained by `tools/demo/lm.py` with the product's `Target` "
            f"(routed experts through the differentiable `{st.get('moe_kernel')}` kernel), float32: "
            f"AdamW (peak lr {st.get('peak_lr')}, betas ({st.get('b1')}, {st.get('b2')}), "
            f"weight decay {st.get('weight_decay')} on matrices, clip {st.get('grad_clip')}), {st.get('warmup_steps')} "
            "warm-up steps then cosine to 10 % over "
            + (f"the run's budget (fraction done = max(steps / {st.get('max_steps')}, time / "
               f"{st.get('max_seconds', 0) / 60:.0f} min)); " if st.get("max_seconds") else
               f"a budget of {st.get('max_steps')} steps; ")
            + f"batch {st.get('batch_size')} random windows of {st.get('seq_len')} tokens; "
            f"seed {st.get('seed')}. Load balance: DeepSeek-V3's auxiliary-loss-free bias update "
            f"(±{st.get('bias_update_rate')} per step towards the mean expert load), no auxiliary loss.",
            "",
            f"   Ran {tg['steps']} steps / {tg['tokens'] / 1e6:.1f}M tokens in {tg['wall_s'] / 60:.1f} min "
            f"of training ({tg.get('cpu_s', 0) / 60:.0f} CPU min, {tg.get('sessions', 1)} session(s)) "
            f"(stopped: {tg['stop_reason']}). Held-out loss {_fmt(tg['best_heldout_loss'])} nats/token "
            f"(best, step {tg['best_step']}); last train loss {_fmt(tg.get('final_train_loss'))}. "
            "The exported weights are the best held-out checkpoint.",
        ]
    rg, dt, dh = s.get("regenerate", {}), s.get("draft_training", {}), s.get("draft_heldout", {})
    dc = s.get("draft_config", {})
    temps = rg.get("temperatures", [0.0])
    lines.append(
        "4. **Regenerate** — `serve.py --emit training --dtype float32 --temperature T` with the target on "
        + (f"{rg['prompts']} prompts cut from the train files, {rg['new_tokens']} new tokens each, dealt "
           f"round-robin over T = {', '.join(f'{t:g}' for t in temps)} (0: greedy), so the draft learns what "
           "this target actually writes, greedy and sampled." if rg else "prompts from the train files. **Pending.**"))
    if dt:
        evals = ", ".join(f"{e['tau']:.2f} (step {e['step']})" for e in dt.get("evals", []))
        lines.append(
            "5. **Draft** — `train.py --config configs/train/demo.yaml` (one decoder layer fusing target layers "
            f"{dc.get('aux_layer_ids')}; training-time test with {dc.get('ttt_steps')} steps; draft vocab "
            f"{dc.get('draft_vocab_size')}; batch {dc.get('batch_size')}, lr {dc.get('lr')}, seed {dc.get('seed')}): "
            f"{dt.get('steps')} steps, final TTT loss {_fmt(dt.get('final_loss'))}, training accuracy by TTT step "
            f"{dt.get('final_acc_per_position')}. Held-out greedy τ during training (K = the config's `eval_draft_tokens`): {evals or 'n/a'}.")
    else:
        lines.append("5. **Draft** — `train.py --config configs/train/demo.yaml` (training-time test, draft vocab "
                     "~2k). **Pending.**")
    pt, pc = s.get("peagle_training", {}), s.get("peagle_config", {})
    if pt:
        pp = pc.get("peagle", {})
        evals = ", ".join(f"{e['tau']:.2f} (step {e['step']})" for e in pt.get("evals", []))
        lines.append(
            "   Then the **P-EAGLE draft** `peagle/` — `train.py --config configs/train/peagle_demo.yaml` "
            f"({pp.get('num_hidden_layers')} decoder layers fusing target layers {pc.get('aux_layer_ids')}, all K "
            f"draft tokens from one pass; COD-sampled depths 0..{(pp.get('num_depths') or 1) - 1}; draft vocab "
            f"{pc.get('draft_vocab_size')}; batch {pc.get('batch_size')}, lr {pc.get('lr')}, seed {pc.get('seed')}; "
            f"same regenerations): {pt.get('steps')} steps, final loss {_fmt(pt.get('final_loss'))}. Held-out greedy "
            f"τ during training (K = {pc.get('eval_draft_tokens')}): {evals or 'n/a'}.")
    lines += dflash_recipe(s)
    lines += [
        "6. **Export** — `target/` through `eagle3_jax.checkpoint.target_map` + the streaming safetensors writer; "
        "checked by loading it with `eagle3_jax.load_target` and with transformers' `DeepseekV3ForCausalLM`, "
        "which must give the same greedy continuation of a held-out prompt. `draft/` is written by train.py "
        "(SpecForge layout) and loaded back with `eagle3_jax.load_draft`.",
        "",
    ]
    if dh:
        lines += [
            "## Acceptance on the held-out prompts",
            "",
            f"K = {dh['num_draft_tokens']} (fixed), {dh['prompts']} prompts × {dh['max_new_tokens']} new tokens; "
            "τ is tokens per target forward pass:",
            "",
            "| T | τ | acceptance by draft position |",
            "|--:|--:|---|",
        ]
        for t, v in dh.get("by_temperature", {"0": dh}).items():
            lines.append(f"| {t} | **{v['tau']:.2f}** | "
                         + ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(v["accept_rate_per_position"])) + " |")
        lines.append("")
    lines += kept_block(old_text)
    lines += one_pass_table(s.get("peagle_heldout", {}), "The P-EAGLE draft (`peagle/`)")
    lines += one_pass_table(s.get("dflash_heldout", {}), "The DFlash draft (`dflash/`)")
    if ex.get("sample"):
        smp = ex["sample"]
        lines += [
            "## Sample (greedy, held-out prompt)",
            "",
            ("eagle3_jax and transformers generate the same tokens" if smp.get("transformers_match", True) else
             "transformers diverges from eagle3_jax at a near-tie of the two best tokens")
            + (f"; teacher-forced logits differ by at most {smp['max_logit_diff']:.1e}." if "max_logit_diff" in smp
               else "."),
            "",
            "Prompt:",
            "```python",
            smp["prompt"].rstrip("\n"),
            "```",
            f"Continuation ({smp['tokens']} tokens):",
            "```python",
            smp["continuation"].rstrip("\n"),
            "```",
            "",
        ]
    pending = []
    if tg.get("stop_reason") == "max_minutes":
        pending.append("- the target stopped at the wall-time cap with its held-out loss still falling (see "
                       "`train_log.jsonl`); a larger `--max-minutes` gives a stronger target")
    if tg.get("stop_reason") == "interrupted":
        pending.append(f"- the target's pre-training stopped at step {tg['steps']} of {st.get('max_steps')}; "
                       "rerun `--stages 3` to continue it")
    if not dh:
        pending.append("- the EAGLE-3 draft (stages 4-5) and its held-out acceptance length τ")
    if pending:
        lines += ["## Not done yet", "", *pending, ""]
    lines += [
        f"Size of `{out}/` when this was written: {demo_bytes / 1e6:.1f} MB (limit 64 MB).",
        "",
        "Rebuild: `python tools/make_demo.py` (all stages) or e.g. `--stages 3,4,5,6`. Stage 3 resumes from "
        "its saved state when rerun with the same settings; its schedule follows steps, not wall time.",
        "",
    ]
    return "\n".join(lines)


def one_pass_table(heldout: dict, what: str) -> list[str]:
    """A one-pass draft's held-out acceptance by temperature (nothing when it was not measured)."""
    if not heldout:
        return []
    lines = [f"{what} at K = {heldout['num_draft_tokens']}, the same prompts:", "",
             "| T | τ | acceptance by draft position |", "|--:|--:|---|"]
    for t, v in heldout["by_temperature"].items():
        lines.append(f"| {t} | **{v['tau']:.2f}** | "
                     + ", ".join(f"{i + 1}: {r:.2f}" for i, r in enumerate(v["accept_rate_per_position"])) + " |")
    return lines + [""]


def layers_text(n) -> str:
    return "one decoder layer" if n == 1 else f"{n} decoder layers"


def dflash_recipe(s: dict) -> list[str]:
    """Stage 5's DFlash paragraph, from its training summary and recipe (nothing before it has run)."""
    dt, dc = s.get("dflash_training", {}), s.get("dflash_config", {})
    if not dt:
        return []
    df, layer = dc.get("dflash", {}), dc.get("draft", {})
    evals = ", ".join(f"{e['tau']:.2f} (step {e['step']})" for e in dt.get("evals", []))
    return [
        "   Then the **DFlash draft** `dflash/` — `train.py --config configs/train/demo_dflash.yaml` "
        f"({layers_text(df.get('num_hidden_layers'))} of width {layer.get('intermediate_size')} over the "
        f"features of target layers {dc.get('aux_layer_ids')}; blocks of {df.get('block_size')}: the newest token "
        f"and {(df.get('block_size') or 2) - 1} guesses from one pass, read by the target's own embedding and head; "
        f"SpecForge's DFlash objective over {df.get('num_anchors')} blocks a row; batch {dc.get('batch_size')}, "
        f"lr {dc.get('lr')}, seed {dc.get('seed')}; same regenerations): {dt.get('steps')} steps, final loss "
        f"{_fmt(dt.get('final_loss'))}. Held-out greedy τ during training (K = {dc.get('eval_draft_tokens')}): "
        f"{evals or 'n/a'}."]
