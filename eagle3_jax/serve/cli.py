"""``python serve.py``: the crash-safe batch generation job.

Everything that can be checked cheaply is checked before the model loads: settings, the target's
config, the tokenizer, every input line, the output file and its settings. Then prompts stream
through the refill-batching engine and each finished prompt is appended to the output at once.
Exit statuses: the parser's epilog.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys
import time
import warnings
from typing import Callable

from eagle3_jax import distributed, preflight
from eagle3_jax.checkpoint.staging import write_json_atomic
from eagle3_jax.config import DTYPES
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.metrics import AcceptanceCollapseWarning
from eagle3_jax.serve.inputs import InputError, PromptRecord, read_prompts
from eagle3_jax.serve.output import ResumableOutput, sidecar_path
from eagle3_jax.serve.progress import Progress, wants_bar
from eagle3_jax.serve.report import RunStats, Watchdog, metrics_dict, summary_table
from eagle3_jax.serve.settings import EMIT_CHOICES, ServeSettings, read_yaml_config

log = logging.getLogger("eagle3_jax")

NO_TARGET_MESSAGE = """\
serve.py generates completions for a JSONL file of prompts with a DeepSeek-V3-class target and,
optionally, an EAGLE-3 draft. Point it at a model:

    python serve.py --target HF_TARGET_DIR [--draft EAGLE3_DRAFT_DIR] \\
        --input prompts.jsonl --output out.jsonl [--max-new-tokens 256] [--mesh data=1,expert=8,tensor=1]

prompts.jsonl has one {"id": ..., "messages": [...]} or {"id": ..., "prompt": "..."} per line
(without "id", the id is derived from the content: "sha256:..."). Rerunning the same command after a crash resumes where it stopped. `python serve.py --help` lists
every option; configs/serve/*.yaml are example --config files.
With no arguments at all it runs the embedded demo (demo/target + demo/draft, see demo/README.md).
"""
BAD_LINES_SHOWN = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="serve.py", description="Crash-safe batch generation with a target and an optional EAGLE-3 draft. "
        "With no arguments at all, runs the embedded demo (demo/target + demo/draft on demo/prompts.jsonl).",
        epilog="Settings may also come from --config FILE.yaml (same keys); flags given here win. Exit status: 0 all "
               "prompts done, 1 an error or some prompts failed (a rerun retries them), 2 bad command line or "
               "config, 130 interrupted (rerun the same command to finish).")
    a = p.add_argument
    a("--target", help="Hugging Face DeepseekV3 / Kimi-K2 / Kimi-K2.5 checkpoint directory (or a converted one)")
    a("--draft", help="EAGLE-3 draft directory (SpecForge / SGLang layout); omit for target-only decoding")
    a("--input", help="prompts JSONL: {\"id\", \"messages\"} or {\"id\", \"prompt\"} per line; a line without "
                      "\"id\" gets one derived from its content (\"sha256:...\")")
    a("--output", help="results JSONL, appended as prompts finish; its settings go to OUTPUT.settings.json")
    a("--max-new-tokens", type=int, help="tokens to generate per prompt (default 256)")
    a("--temperature", type=float, help="0 = greedy (default); > 0 samples")
    a("--top-p", type=float, help="nucleus sampling mass (default 1.0 = off)")
    a("--top-k", type=int, help="sample from the k most likely tokens (default 0 = off)")
    a("--num-draft-tokens", help="draft tokens per verify round, or 'auto' (default): chosen from measured "
      "round costs and live acceptance, 0 (target-only) when speculation does not pay")
    a("--k-table", help="under auto: the K a job starts from per batch size, e.g. 1:0,8:2 (default: what earlier "
                        "jobs of the pair measured on this machine, else a short probe)")
    a("--batch-size", type=int, help="rows generated together (default 8)")
    a("--max-len", type=int, help="prompt + generation capacity per row in tokens (default 2048); may change "
                                   "between runs of one output: longer prompts that failed are retried")
    a("--admit-rows", type=int, help="the most rows one prefill call admits (default: the whole batch); "
                                     "fewer bound prefill memory, as `python -m tools.plan --admit-rows` plans")
    a("--prefill-chunk", type=int, help="prompt positions per target call in prefill (default: the whole "
                                        "prompt); bounds prefill temporaries, never changes the tokens")
    a("--mesh", help="device mesh, e.g. data=1,expert=8,tensor=1; 'auto' (default) puts every device on expert, "
                     "'none' runs on one device")
    a("--seed", type=int, help="sampling seed (default 0)")
    a("--emit", choices=EMIT_CHOICES, help="'text' (default): id, text, num_tokens, finish_reason, accept_length; "
                                          "'training': the prompt's messages + the generated assistant turn")
    a("--metrics", help="write the run's totals (tok/s, tau, per-position acceptance) to this JSON file")
    a("--config", help="YAML file of defaults for the options above")
    a("--overwrite", action="store_const", const=True, default=None,
      help="discard an existing output written with other settings and start over")
    a("--skip-bad-lines", action="store_const", const=True, default=None,
      help="skip malformed input lines (reported) instead of stopping before generation")
    a("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
      help="compute dtype; 'auto' (default) = the checkpoint's torch_dtype, but float32 on a CPU host (XLA:CPU "
           "computes half-precision matmuls through float32 copies)")
    a("--no-progress", action="store_const", const=True, default=None,
      help="plain log lines instead of a progress bar (the bar is drawn only when stderr is a terminal)")
    # Multi-host: the same command on every host; process 0 writes the output, sidecar and metrics.
    distributed.add_flags(p)
    return p


def settings_from_argv(argv) -> ServeSettings:
    ns = vars(build_parser().parse_args(argv))
    config_path = ns.pop("config")
    yaml_values = read_yaml_config(config_path) if config_path else {}
    return ServeSettings.merged(yaml_values, ns)


# ---------------------------------------------------------------------- helpers
def checkpoint_dtype_name(target_cfg) -> str:
    """The checkpoint's torch_dtype (its text model's for Kimi-K2.5), bfloat16 when it names none we support."""
    return preflight.torch_dtype(target_cfg.hf_config or {}, DTYPES) or "bfloat16"


def resolve_dtype_name(dtype: str, target_cfg, platform: str | None = None) -> tuple[str, str | None]:
    """(the compute dtype, a line saying why it is slow or not the checkpoint's, or None).

    ``auto`` follows the checkpoint except on a CPU host, where float32 runs faster (backends.py)."""
    from eagle3_jax import backends

    if platform is None:
        import jax

        platform = jax.default_backend()
    if dtype != "auto":
        return dtype, backends.half_on_cpu_note(dtype, platform)
    return backends.auto_dtype(checkpoint_dtype_name(target_cfg), platform)


def resolve_mesh(spec: str):
    import jax

    from eagle3_jax.sharding import make_mesh

    if spec == "auto":
        return make_mesh(None) if jax.device_count() > 1 else None
    return None if spec == "none" else make_mesh(spec)


def load_models(s: ServeSettings, dtype: str, facts: preflight.PairFacts | None = None):
    """``facts``: what ``preflight.check_pair`` found for this pair (configs read once, not checked again)."""
    import eagle3_jax as e3

    mesh = resolve_mesh(s.mesh)
    log.info("loading target %s (%s%s)", s.target, dtype, f", mesh {dict(mesh.shape)}" if mesh is not None else "")
    target = e3.load_target(s.target, dtype=dtype, mesh=mesh, config=facts.target if facts else None)
    draft = None
    if s.draft:
        log.info("loading draft %s", s.draft)
        draft = e3.load_draft(s.draft, target, checked=facts)
    return target, draft


# Why a prompt failed, as the summary counts them.
FAIL_TEMPLATE, FAIL_EMPTY, FAIL_TOO_LONG = "chat template failed", "empty prompt", "prompt too long for max_len"
FAIL_GENERATION = "generation failed"


def tokenize(tok, rec: PromptRecord, max_len: int) -> tuple[list[int] | None, str | None, str | None]:
    """(token ids, None, None), or (None, the error for this prompt's finish_reason, its short reason)."""
    import jinja2

    try:
        ids = tok.encode_chat(rec.messages) if rec.messages is not None else tok.encode(rec.prompt)
    except jinja2.TemplateError as e:
        return None, f"error: chat template failed on this conversation: {e}", FAIL_TEMPLATE
    if not ids:
        return None, "error: prompt is empty (0 tokens)", FAIL_EMPTY
    if len(ids) >= max_len:
        return None, f"error: prompt has {len(ids)} tokens, max_len is {max_len}", FAIL_TOO_LONG
    return ids, None, None


def result_record(rec: PromptRecord, emit: str, text: str, num_tokens: int, finish_reason: str,
                  accept_length: float | None) -> dict:
    if emit == "training":
        msgs = list(rec.prompt_messages())
        if not finish_reason.startswith("error"):
            msgs.append({"role": "assistant", "content": text})
        return {"id": rec.id, "messages": msgs, "finish_reason": finish_reason}
    return {"id": rec.id, "text": text, "num_tokens": num_tokens, "finish_reason": finish_reason,
            "accept_length": accept_length}


def generation_text(tok, tokens: list[int], finish_reason: str) -> str:
    # The stop token ends the answer; it is not part of it.
    if finish_reason == "eos" and tokens and tokens[-1] in tok.eos_token_ids:
        tokens = tokens[:-1]
    return tok.decode(tokens)


# ---------------------------------------------------------------------- the job
def run(s: ServeSettings, models: Callable | None = None, engine_module=None) -> int:
    """Runs the job. ``models(settings, dtype) -> (target, draft)`` and ``engine_module`` (with
    ``Engine`` and ``Request``) replace the defaults in tests."""
    from eagle3_jax.config import TargetConfig
    from eagle3_jax.tokenizer import TokenizerError, check_vocab, load_tokenizer

    s.validate()
    s.check_paths()
    target_cfg = TargetConfig.from_path(s.target)
    dtype, dtype_note = resolve_dtype_name(s.dtype, target_cfg)
    if dtype_note:   # auto chose float32 over the checkpoint's dtype (said), or a half dtype was asked (warned)
        (log.info if s.dtype == "auto" else log.warning)("--dtype %s: %s", s.dtype, dtype_note)
    # Before any output, and the one read of each config: load_models takes what it found (and
    # load_target keeps quantized weights as stored).
    facts = preflight.check_pair(s.target, s.draft, mesh=s.mesh, dtype=dtype, max_len=s.max_len, weights="native",
                                 target_config=target_cfg)
    tok = load_tokenizer(s.target)
    check_vocab(tok, target_cfg.vocab_size, s.target)
    log.info("%s", tok.describe())

    records, bad = read_prompts(s.input)
    if bad:
        shown = "\n  ".join(bad[:BAD_LINES_SHOWN]) + (f"\n  ... and {len(bad) - BAD_LINES_SHOWN} more"
                                                     if len(bad) > BAD_LINES_SHOWN else "")
        if not s.skip_bad_lines:
            raise InputError(f"{s.input}: {len(bad)} malformed line(s); nothing was generated. Fix them or pass "
                             f"--skip-bad-lines:\n  {shown}")
        log.warning("%s: skipping %d malformed line(s):\n  %s", s.input, len(bad), shown)
    # Statistics are as wide as the largest K a round may use (under auto the per-round K varies).
    from eagle3_jax.speculative.autodraft import DEFAULT_MAX_DRAFT_TOKENS

    k = (DEFAULT_MAX_DRAFT_TOKENS if s.num_draft_tokens == "auto" else s.num_draft_tokens) if s.draft else 0
    stats = RunStats(k, pair=(s.target, s.draft))
    if not records:
        print(f"{s.input} has no prompts; nothing to do.")
        _write_metrics(s, stats, 0, len(bad), dtype)
        return 0
    if tok.chat_template is None and any(r.messages is not None for r in records):
        raise TokenizerError(f"{s.target}: the inputs have 'messages' but the tokenizer has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja); add one or give "
                             "plain 'prompt' inputs")

    fingerprint = s.fingerprint(dtype, tok.eos_token_ids, tok.kind)
    with ResumableOutput(s.output, fingerprint, s.overwrite, max_len=s.max_len) as out:
        pending = [r for r in records if r.key not in out.done]
        already = len(records) - len(pending)
        if already:
            log.info("%s: %d of %d prompts already done; generating the other %d", s.output, already,
                     len(records), len(pending))
        if not pending:
            print(f"all {len(records)} prompts are already in {s.output}; nothing to do.")
            _write_metrics(s, stats, already, len(bad), dtype)
            return 0
        log.info("settings recorded in %s", sidecar_path(s.output))
        requests, by_key = [], {}
        engine_module = engine_module or importlib.import_module("eagle3_jax.speculative.engine")
        for rec in pending:
            ids, error, failure = tokenize(tok, rec, s.max_len)
            if error is not None:
                log.warning("prompt %s (line %d): %s", rec.key, rec.line, error)
                out.append(result_record(rec, s.emit, "", 0, error, None))
                stats.add(error, failure=failure)
                continue
            requests.append(engine_module.Request(key=rec.key, prompt=ids))
            by_key[rec.key] = rec
        if requests:
            _generate(s, tok, dtype, requests, by_key, out, stats,
                      models or functools.partial(load_models, facts=facts), engine_module)

    print(summary_table(stats, already, len(bad)))
    _write_metrics(s, stats, already, len(bad), dtype)
    if stats.errors:
        print(f"serve.py: {stats.errors} of {stats.prompts} prompts failed: {stats.failure_summary()}. Their rows in "
              f"{s.output} have finish_reason \"error: ...\"; rerunning retries them (e.g. with a larger --max-len).",
              file=sys.stderr)
        return 1
    return 0


def _write_metrics(s: ServeSettings, stats: RunStats, already: int, skipped_lines: int, dtype: str) -> None:
    if s.metrics and distributed.is_writer():
        os.makedirs(os.path.dirname(os.path.abspath(s.metrics)), exist_ok=True)
        write_json_atomic(s.metrics, metrics_dict(stats, already, skipped_lines, dict(s.as_dict(), dtype=dtype)))
        log.info("metrics written to %s", s.metrics)


def _generate(s, tok, dtype, requests, by_key, out, stats: RunStats, models, engine_module) -> None:
    from eagle3_jax.speculative.session import bucket_prompt_len

    started = time.perf_counter()
    target, draft = models(s, dtype)
    stats.load_seconds = time.perf_counter() - started
    k = stats.num_draft_tokens
    engine = engine_module.Engine(
        target, draft=draft, num_draft_tokens=s.num_draft_tokens, max_len=s.max_len, batch_size=s.batch_size,
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        eos_token_ids=tuple(tok.eos_token_ids), max_admit_rows=s.admit_rows, prefill_chunk=s.prefill_chunk,
        **_auto_settings(s, dtype))
    # Under auto the per-round K varies; the Engine runs the acceptance check on speculating rounds.
    watchdog = Watchdog(0 if s.num_draft_tokens == "auto" else k, context=s.output, pair=(s.target, s.draft))
    buckets: set[int] = set()
    prompt_tokens = {req.key: len(req.prompt) for req in requests}   # for tau by context length
    compiling = ["compiling the decode programs…"]   # what the progress line says while XLA compiles

    def handed_to_engine(reqs):
        # The engine pulls prompts as rows free up; a prompt-length bucket not seen before means
        # its admission program is compiled next (this is the only place the host knows that).
        for req in reqs:
            bucket = bucket_prompt_len(len(req.prompt), s.max_len)
            if buckets and bucket not in buckets:
                compiling[0] = f"compiling prompt bucket {bucket}…"
            buckets.add(bucket)
            yield req

    with Progress(len(requests), wants_bar(s.no_progress), quiet=not distributed.is_writer()) as progress:
        stats.start_clock()
        with stats.compiling(lambda: progress.note(compiling[0])):
            for fin in engine.run(handed_to_engine(requests)):
                rec = by_key[fin.key]
                tau = round(fin.stats.mean_accept_length, 4) if k and fin.stats.rounds else None
                out.append(result_record(rec, s.emit, generation_text(tok, fin.tokens, fin.finish_reason),
                                         len(fin.tokens), fin.finish_reason, tau))
                stats.add(fin.finish_reason, fin.stats, failure=FAIL_GENERATION, prompt_tokens=prompt_tokens[fin.key])
                stats.draft_choice = getattr(engine, "draft_choice", None)
                stats.tick()
                compiling[0] = "compiling…"
                progress.advance(stats.postfix())
                watchdog.maybe_check(stats)
        stats.draft_choice = getattr(engine, "draft_choice", None)
        stats.tick()


def _auto_settings(s: ServeSettings, dtype: str) -> dict:
    """Under auto: the user's K table, and where auto's measurements are kept (beside the compile
    cache, while it is on)."""
    from eagle3_jax import compile_cache
    from eagle3_jax.serve.settings import parse_k_table
    from eagle3_jax.speculative.calibration import CalibrationStore

    if not s.draft or s.num_draft_tokens != "auto":
        return {}
    directory = compile_cache.calibration_dir()
    store = CalibrationStore.for_pair(directory, s.target, s.draft, dtype, s.mesh) if directory else None
    return {"calibration": store, "k_table": parse_k_table(s.k_table) if s.k_table else None}


def _join_process_group(argv) -> None:
    """Multi-host (--coordinator/--num-processes/--process-id or EAGLE3_* env): joins the process
    group; every process then runs the same generation, and only process 0 draws the progress bar."""
    ns, _ = build_parser().parse_known_args(argv)
    if distributed.initialize(ns.coordinator, ns.num_processes, ns.process_id) and not distributed.is_writer():
        os.environ["TQDM_DISABLE"] = "1"


def main(argv=None, models: Callable | None = None, engine_module=None, demo_dir: str | None = None) -> int:
    """``demo_dir``: where the embedded demo lives (serve.py passes the checkout's demo/); with no
    arguments and a complete demo there, the demo runs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv and demo_dir is not None:
        from eagle3_jax.serve import demo

        if demo.available(demo_dir):
            try:
                return demo.run(demo_dir)
            except Eagle3Error as e:
                print(f"serve.py: error: {e}", file=sys.stderr)
                return 1
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                            datefmt="%H:%M:%S")
    # our own notices (resuming, compile times) at INFO whoever configured the root logger first:
    # importing orbax logs through absl, which installs a root handler when none is there
    log.setLevel(logging.INFO)
    # The watchdog logs its warning (above the progress bar); the same text as a Python warning
    # would only print it a second time.
    warnings.simplefilter("ignore", AcceptanceCollapseWarning)
    try:
        _join_process_group(argv)   # before anything touches JAX's devices
        s = settings_from_argv(argv)
    except Eagle3Error as e:
        print(f"serve.py: error: {e}", file=sys.stderr)
        return 2
    if not s.target:
        print(NO_TARGET_MESSAGE)
        if s.input or s.output:
            print("serve.py: error: --target is required to generate", file=sys.stderr)
            return 2
        return 0
    try:
        return run(s, models=models, engine_module=engine_module)
    except Eagle3Error as e:
        print(f"serve.py: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 1)   # 2: a bad setting (errors.SettingsError); 1: the run failed
    except KeyboardInterrupt:
        print(f"\nserve.py: interrupted; finished prompts are saved in {s.output}. Rerun the same command to "
              "finish the rest.", file=sys.stderr)
        return 130
