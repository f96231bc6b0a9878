"""``python serve.py`` with no arguments: the embedded demo.

Loads ``demo/target`` and ``demo/draft`` through the public loaders, generates completions for
the bundled held-out prompts twice — target-only, then with the EAGLE-3 draft — in the same
process on the same batches, prints a few completions and a table: tokens/s of both, their
ratio, the mean acceptance length tau and the per-position acceptance. Greedy decoding is
lossless, so both runs must produce the same tokens; the demo checks that too.

Every compiled shape is fixed (batch size, padded prompt length, max_new_tokens), so each mode
compiles once in an untimed warm-up call; the timed numbers are steady state.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, fields

from eagle3_jax.config import read_yaml_mapping
from eagle3_jax.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_DIR = os.path.join(REPO, "demo")
SHOWN_COMPLETIONS = 3
SHOWN_LINES = 8


@dataclass(frozen=True)
class DemoSettings:
    """``demo/demo.yaml``: what the demo runs (written by tools/make_demo.py with the shipped K)."""

    num_draft_tokens: int = 6
    batch_size: int = 8
    num_prompts: int = 16
    max_new_tokens: int = 96
    dtype: str = "float32"   # CPU backends have no fast bfloat16 matmuls

    @classmethod
    def load(cls, demo_dir: str) -> "DemoSettings":
        path = os.path.join(demo_dir, "demo.yaml")
        if not os.path.isfile(path):
            return cls()
        raw = read_yaml_mapping(path)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {unknown}; valid keys: {sorted(names)}")
        return cls(**raw)


def available(demo_dir: str = DEMO_DIR) -> bool:
    return all(os.path.isfile(os.path.join(demo_dir, *p)) for p in (
        ("target", "config.json"), ("draft", "config.json"), ("prompts.jsonl",)))


def read_prompts(path: str, n: int) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if len(rows) < n:
        raise ConfigError(f"{path} has {len(rows)} prompts; the demo needs {n} (demo.yaml num_prompts)")
    return rows[:n]


@dataclass
class ModeRun:
    name: str
    tokens: list[list[int]]
    seconds: float
    compile_seconds: float
    rounds: int = 0
    round_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tau(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else float("nan")


def run_mode(generator, name: str, batches: list[list[list[int]]], s: DemoSettings, prompt_len: int,
             eos: tuple[int, ...]) -> ModeRun:
    def call(batch):
        return generator.generate(batch, s.max_new_tokens, eos_token_ids=eos, prompt_len=prompt_len)

    t = time.perf_counter()
    call(batches[0])   # compiles; its tokens are not counted
    compile_s = time.perf_counter() - t
    run = ModeRun(name, [], 0.0, compile_s, accepted_per_position=(0,) * generator.num_draft_tokens)
    for batch in batches:
        res = call(batch)
        run.tokens += res.tokens
        run.seconds += res.stats.seconds
        run.rounds += res.stats.rounds
        run.round_tokens += res.stats.round_tokens
        run.accepted_per_position = tuple(a + b for a, b in zip(run.accepted_per_position,
                                                                res.stats.accepted_per_position))
    return run


def show_completion(tok, prompt_text: str, tokens: list[int], eos: tuple[int, ...]) -> str:
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    head = prompt_text.rstrip("\n").split("\n")[-2:]
    body = tok.decode(tokens).split("\n")
    more = len(body) - SHOWN_LINES
    lines = ["    " + ln for ln in head] + ["  > " + ln for ln in body[:SHOWN_LINES]]
    if more > 0:
        lines.append(f"  > ... ({more} more lines)")
    return "\n".join(lines)


def table(base: ModeRun, spec: ModeRun, k: int) -> str:
    rates = [a / spec.rounds for a in spec.accepted_per_position] if spec.rounds else []
    rows = [
        ("", "target-only", f"EAGLE-3 (K={k})"),
        ("new tokens", f"{base.new_tokens}", f"{spec.new_tokens}"),
        ("seconds", f"{base.seconds:.2f}", f"{spec.seconds:.2f}"),
        ("tok/s", f"{base.tokens_per_second:.1f}", f"{spec.tokens_per_second:.1f}"),
        ("speedup", "1.00x", f"{spec.tokens_per_second / base.tokens_per_second:.2f}x"),
        ("tau (tokens per target step)", "1.00", f"{spec.tau:.2f}"),
        ("compile (untimed)", f"{base.compile_seconds:.1f} s", f"{spec.compile_seconds:.1f} s"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    out = [f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows]
    out.append("  acceptance by draft position: " + "  ".join(f"{i + 1}:{r:.2f}" for i, r in enumerate(rates)))
    return "\n".join(out)


def run(demo_dir: str = DEMO_DIR) -> int:
    import jax

    import eagle3_jax as e3
    from eagle3_jax.tokenizer import load_tokenizer

    s = DemoSettings.load(demo_dir)
    target_dir, draft_dir = os.path.join(demo_dir, "target"), os.path.join(demo_dir, "draft")
    prompts = read_prompts(os.path.join(demo_dir, "prompts.jsonl"), s.num_prompts)
    tok = load_tokenizer(target_dir)
    eos = tuple(tok.eos_token_ids)
    ids = [tok.encode(p["prompt"]) for p in prompts]
    max_prompt = max(len(i) for i in ids)
    prompt_len = -(-max_prompt // 16) * 16
    max_len = prompt_len + s.max_new_tokens + s.num_draft_tokens + 2
    batches = [ids[i:i + s.batch_size] for i in range(0, len(ids), s.batch_size)]
    if len(batches[-1]) != s.batch_size:
        raise ConfigError(f"{demo_dir}/demo.yaml: num_prompts ({s.num_prompts}) must be a multiple of batch_size "
                          f"({s.batch_size}) so every batch shares one compiled program")

    print(f"eagle3-jax demo: {os.path.relpath(target_dir)} + {os.path.relpath(draft_dir)}, {len(ids)} held-out "
          f"prompts ({os.path.relpath(demo_dir)}/prompts.jsonl), greedy, {s.max_new_tokens} new tokens each, "
          f"batch {s.batch_size}, {s.dtype}", flush=True)
    t = time.perf_counter()
    target = e3.load_target(target_dir, dtype=s.dtype)
    draft = e3.load_draft(draft_dir, target)
    n_params = sum(x.size for x in jax.tree.leaves(target.state))
    print(f"loaded in {time.perf_counter() - t:.1f}s: target {n_params / 1e6:.1f}M parameters "
          f"({target.config.n_routed_experts} routed experts top-{target.config.num_experts_per_tok}), draft fuses "
          f"target layers {list(draft.aux_layer_ids)}", flush=True)

    base = run_mode(e3.Generator(target, None, max_len=max_len), "target-only", batches, s, prompt_len, eos)
    print(f"target-only: {base.tokens_per_second:.1f} tok/s", flush=True)
    spec = run_mode(e3.Generator(target, draft, num_draft_tokens=s.num_draft_tokens, max_len=max_len), "eagle3",
                    batches, s, prompt_len, eos)
    print(f"EAGLE-3:     {spec.tokens_per_second:.1f} tok/s", flush=True)

    same = sum(a == b for a, b in zip(base.tokens, spec.tokens))
    print()
    for p, toks in list(zip(prompts, spec.tokens))[:SHOWN_COMPLETIONS]:
        print(f"[{p['id']}]")
        print(show_completion(tok, p["prompt"], toks, eos))
        print()
    print(table(base, spec, s.num_draft_tokens))
    print(f"  identical tokens (greedy is lossless): {same}/{len(ids)} prompts")
    if same != len(ids):
        print("error: speculative decoding changed the output; this is a bug, please report it")
        return 1
    return 0
