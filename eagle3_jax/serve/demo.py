"""``python serve.py`` with no arguments: the embedded demo.

Loads ``demo/target`` and ``demo/draft`` through the public loaders, generates completions for
the bundled held-out prompts twice — target-only, then with the EAGLE-3 draft — in the same
process on the same prompts, prints a few completions and a table: tokens/s of both, their
ratio, the mean acceptance length tau and the per-position acceptance. Greedy decoding is
lossless, so both runs must produce the same tokens; the demo checks that too.

Both modes run every prompt through the refill ``Engine`` on ``batch_size`` rows (a freed row
takes the next prompt), as ``serve.py`` does. Each mode first runs once untimed: that compiles its
programs and, under ``num_draft_tokens: auto``, calibrates the round costs and learns which K pays;
the timed pass is steady state.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from eagle3_jax import settings_io
from eagle3_jax.errors import ConfigError

SHOWN_COMPLETIONS = 3
SHOWN_LINES = 8


@dataclass(frozen=True)
class DemoSettings:
    """``demo/demo.yaml``: what the demo runs (written by tools/make_demo.py with the shipped K)."""

    num_draft_tokens: int | str = "auto"   # or a fixed K
    batch_size: int = 8
    num_prompts: int = 16
    max_new_tokens: int = 96
    dtype: str = "float32"   # CPU backends have no fast bfloat16 matmuls

    @classmethod
    def load(cls, demo_dir: str) -> "DemoSettings":
        path = os.path.join(demo_dir, "demo.yaml")
        if not os.path.isfile(path):
            return cls()
        from eagle3_jax.serve.settings import draft_tokens_setting

        return settings_io.from_layers(cls, [settings_io.yaml_layer(path, where=path)],
                                       {"num_draft_tokens": draft_tokens_setting})


def available(demo_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(demo_dir, *p)) for p in (
        ("target", "config.json"), ("draft", "config.json"), ("prompts.jsonl",)))


def read_prompts(path: str, n: int | None = None) -> list[dict]:
    """The first ``n`` prompt records (all of them when n is None)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if n is not None and len(rows) < n:
        raise ConfigError(f"{path} has {len(rows)} prompts; the demo needs {n} (demo.yaml num_prompts)")
    return rows if n is None else rows[:n]


@dataclass
class DemoPair:
    """The demo target + draft loaded through the public loaders, and the tokenized held-out prompts."""

    demo_dir: str
    settings: DemoSettings
    target: object            # LoadedTarget
    draft: object             # LoadedDraft
    tokenizer: object
    prompts: list[dict]       # {"id", "prompt"} records
    prompt_ids: list[list[int]]

    @classmethod
    def load(cls, demo_dir: str, num_prompts: int | None = None) -> "DemoPair":
        """``num_prompts=None``: every prompt in prompts.jsonl."""
        import eagle3_jax as e3
        from eagle3_jax.tokenizer import load_tokenizer

        settings = DemoSettings.load(demo_dir)
        target_dir, draft_dir = os.path.join(demo_dir, "target"), os.path.join(demo_dir, "draft")
        prompts = read_prompts(os.path.join(demo_dir, "prompts.jsonl"), num_prompts)
        tok = load_tokenizer(target_dir)
        target = e3.load_target(target_dir, dtype=settings.dtype)
        draft = e3.load_draft(draft_dir, target)
        return cls(demo_dir, settings, target, draft, tok, prompts, [tok.encode(p["prompt"]) for p in prompts])

    @property
    def eos(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_token_ids)

    @property
    def prompt_len(self) -> int:
        """The longest prompt's bucket: pinned for every batch, so all share one compiled program."""
        from eagle3_jax.speculative.session import PROMPT_BUCKET

        return -(-max(len(p) for p in self.prompt_ids) // PROMPT_BUCKET) * PROMPT_BUCKET

    def capacity(self, max_new_tokens: int, k: int | str) -> int:
        from eagle3_jax.speculative.autodraft import DEFAULT_MAX_DRAFT_TOKENS

        return self.prompt_len + max_new_tokens + (DEFAULT_MAX_DRAFT_TOKENS if k == "auto" else k) + 2

    def generator(self, k: int | str, max_new_tokens: int, batch_size: int | None = None):
        """Target-only decoding when ``k`` is 0, else EAGLE-3 with ``k`` draft tokens per round
        (``"auto"``: chosen as it runs). With ``batch_size`` rows for more prompts, the refill Engine."""
        import eagle3_jax as e3

        return e3.Generator(self.target, self.draft if k else None, num_draft_tokens=k,
                            max_len=self.capacity(max_new_tokens, k), batch_size=batch_size)

    def generate(self, generator, batches: list[list[list[int]]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0):
        """Every batch through ``generator`` (batch i sampled with seed + i): the tokens of all rows, in
        order, and the combined statistics."""
        from eagle3_jax.metrics import GenerationStats

        tokens, stats = [], []
        for i, batch in enumerate(batches):
            res = generator.generate(batch, max_new_tokens, temperature=temperature, seed=seed + i,
                                     eos_token_ids=self.eos, prompt_len=self.prompt_len)
            tokens += res.tokens
            stats.append(res.stats)
        return tokens, GenerationStats.combine(stats)


def batches_of(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


@dataclass
class ModeRun:
    tokens: list[list[int]]
    stats: object             # GenerationStats of the timed pass (compiles excluded)
    compile_seconds: float    # the untimed first pass: compiles, calibration, first executions
    choice: object = None     # under auto: the DraftChoice after the timed pass


def run_mode(pair: DemoPair, k: int | str) -> ModeRun:
    s = pair.settings
    gen = pair.generator(k, s.max_new_tokens, s.batch_size)
    t = time.perf_counter()
    gen.generate(pair.prompt_ids, s.max_new_tokens, eos_token_ids=pair.eos)   # compiles; not counted
    compile_s = time.perf_counter() - t
    res = gen.generate(pair.prompt_ids, s.max_new_tokens, eos_token_ids=pair.eos)
    return ModeRun(res.tokens, res.stats, compile_s, gen.draft_choice)


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


def mode_label(spec: ModeRun, k: int | str) -> str:
    if spec.choice is None:
        return f"EAGLE-3 (K={k})"
    return f"EAGLE-3 (K=auto, now {spec.choice.num_draft_tokens})"


def table(base: ModeRun, spec: ModeRun, k: int | str) -> str:
    b, e = base.stats, spec.stats
    rows = [
        ("", "target-only", mode_label(spec, k)),
        ("new tokens", f"{b.tokens}", f"{e.tokens}"),
        ("seconds", f"{b.seconds:.2f}", f"{e.seconds:.2f}"),
        ("tok/s", f"{b.tokens_per_second:.1f}", f"{e.tokens_per_second:.1f}"),
        ("speedup", "1.00x", f"{e.tokens_per_second / b.tokens_per_second:.2f}x"),
        ("tau (tokens per target step)", "1.00", f"{e.mean_accept_length:.2f}"),
        ("compile (untimed)", f"{base.compile_seconds:.1f} s", f"{spec.compile_seconds:.1f} s"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    out = [f"  {a:<{w0}}  {c1:>{w1}}  {c2}" for a, c1, c2 in rows]
    out.append("  acceptance by draft position: "
               + "  ".join(f"{i + 1}:{r:.2f}" for i, r in enumerate(e.accept_rate_per_position)))
    c = spec.choice
    if c is not None:
        runs = ", ".join(f"K={j}: {n}" for j, n in sorted(c.rounds_per_k.items()))
        out.append(f"  auto: loop iterations per K ({runs}); the round model predicts "
                   f"{c.predicted_speedup:.2f}x at K={c.num_draft_tokens}")
    return "\n".join(out)


def run(demo_dir: str) -> int:
    import jax

    s = DemoSettings.load(demo_dir)
    t = time.perf_counter()
    pair = DemoPair.load(demo_dir, s.num_prompts)
    print(f"eagle3-jax demo: {os.path.relpath(demo_dir)}/target + {os.path.relpath(demo_dir)}/draft, "
          f"{len(pair.prompt_ids)} held-out prompts ({os.path.relpath(demo_dir)}/prompts.jsonl), greedy, "
          f"{s.max_new_tokens} new tokens each, {s.batch_size} rows refilled as prompts finish, {s.dtype}",
          flush=True)
    n_params = sum(x.size for x in jax.tree.leaves(pair.target.state))
    c = pair.target.config
    print(f"loaded in {time.perf_counter() - t:.1f}s: target {n_params / 1e6:.1f}M parameters "
          f"({c.n_routed_experts} routed experts top-{c.num_experts_per_tok}), draft fuses "
          f"target layers {list(pair.draft.aux_layer_ids)}", flush=True)

    base = run_mode(pair, 0)
    print(f"target-only: {base.stats.tokens_per_second:.1f} tok/s", flush=True)
    spec = run_mode(pair, s.num_draft_tokens)
    print(f"EAGLE-3:     {spec.stats.tokens_per_second:.1f} tok/s", flush=True)

    same = sum(a == b for a, b in zip(base.tokens, spec.tokens))
    print()
    for p, toks in list(zip(pair.prompts, spec.tokens))[:SHOWN_COMPLETIONS]:
        print(f"[{p['id']}]")
        print(show_completion(pair.tokenizer, p["prompt"], toks, pair.eos))
        print()
    print(table(base, spec, s.num_draft_tokens))
    print(f"  identical tokens (greedy is lossless): {same}/{len(pair.prompt_ids)} prompts")
    if same != len(pair.prompt_ids):
        print("error: speculative decoding changed the output; this is a bug, please report it")
        return 1
    return 0
