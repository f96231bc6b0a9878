"""``python serve.py`` with no arguments: the embedded demo.

For every batch size and temperature of ``demo/demo.yaml`` it generates the bundled held-out
prompts target-only and with the EAGLE-3 draft (and, when demo.yaml names their K, the one-pass
P-EAGLE and DFlash drafts), each through the refill ``Engine`` as ``serve.py`` does, and prints a
few completions and one table: tok/s, speedup, K, tau and per-position acceptance. At temperature
0 every mode must produce target-only's tokens (lossless); the demo checks that.

Each mode first runs once untimed (compiles; under auto, calibrates). Then ``timed_passes`` rounds
run every mode once each, in turn, so a busy moment of the machine hits all alike: tok/s is the
median pass, a speedup the median of the per-pass ratios, printed with their range.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from dataclasses import dataclass

from eagle3_jax import settings_io
from eagle3_jax.errors import ConfigError

SHOWN_COMPLETIONS = 3
SHOWN_LINES = 8
# The one-pass drafts run beside the chain one: label, directory under the demo, the demo.yaml key of
# its fixed K, and its training recipe (named when the draft is missing).
ONE_PASS_DRAFTS = (("P-EAGLE", "peagle", "parallel_draft_tokens", "configs/train/peagle_demo.yaml"),
                   ("DFlash", "dflash", "dflash_draft_tokens", "configs/train/demo_dflash.yaml"))


@dataclass(frozen=True)
class DemoSettings:
    """``demo/demo.yaml`` (written by tools/make_demo.py): every batch size runs at every temperature."""

    num_draft_tokens: int | str = "auto"   # or a fixed K
    parallel_draft_tokens: int = 0         # K of the P-EAGLE draft in demo/peagle, run beside (0: not run)
    dflash_draft_tokens: int = 0           # K of the DFlash draft in demo/dflash, run beside (0: not run)
    batch_sizes: tuple[int, ...] = (1, 8)
    num_prompts: tuple[int, ...] = (4, 16)     # prompts per batch size, in the same order
    temperatures: tuple[float, ...] = (0.0, 1.0)   # 0: greedy (its tokens are checked against target-only)
    max_new_tokens: int = 96
    dtype: str = "float32"   # CPU backends have no fast bfloat16 matmuls
    seed: int = 0
    timed_passes: int = 3    # paired passes per case after the untimed one; medians and ranges over them

    def __post_init__(self):
        if len(self.batch_sizes) != len(self.num_prompts) or not self.batch_sizes:
            raise ConfigError(f"demo.yaml: batch_sizes {list(self.batch_sizes)} and num_prompts "
                              f"{list(self.num_prompts)} must be lists of the same length (prompts per batch size)")
        if any(b < 1 for b in self.batch_sizes) or any(n < 1 for n in self.num_prompts):
            raise ConfigError(f"demo.yaml: batch_sizes and num_prompts must be >= 1, found "
                              f"{list(self.batch_sizes)} and {list(self.num_prompts)}")
        for label, _, key, _ in ONE_PASS_DRAFTS:
            if getattr(self, key) < 0:
                raise ConfigError(f"demo.yaml: {key} must be >= 0 (0: no {label} run), found {getattr(self, key)}")
        if self.timed_passes < 1:
            raise ConfigError(f"demo.yaml: timed_passes must be >= 1, found {self.timed_passes}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ConfigError(f"demo.yaml: temperatures must be one or more values >= 0, found {list(self.temperatures)}")

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
    one_pass: dict = None     # label -> (LoadedDraft, K) of each one-pass draft the settings run

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
        one_pass = {}
        for label, sub, key, recipe in ONE_PASS_DRAFTS:
            k, where = getattr(settings, key), os.path.join(demo_dir, sub)
            if not k:
                continue
            if not os.path.isfile(os.path.join(where, "config.json")):
                raise ConfigError(f"demo.yaml asks for {key} {k} but {where} holds no {label} draft; set it to 0 "
                                  f"or train one ({recipe})")
            one_pass[label] = (e3.load_draft(where, target), k)
        return cls(demo_dir, settings, target, draft, tok, prompts, [tok.encode(p["prompt"]) for p in prompts],
                   one_pass)

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

        most = max([DEFAULT_MAX_DRAFT_TOKENS if k == "auto" else k]
                   + [getattr(self.settings, key) for _, _, key, _ in ONE_PASS_DRAFTS])
        return self.prompt_len + max_new_tokens + most + 2

    def generator(self, k: int | str, max_new_tokens: int, batch_size: int | None = None):
        """Target-only decoding when ``k`` is 0, else EAGLE-3 with ``k`` (or ``"auto"``) draft tokens per round."""
        import eagle3_jax as e3

        return e3.Generator(self.target, self.draft if k else None, num_draft_tokens=k,
                            max_len=self.capacity(max_new_tokens, k), batch_size=batch_size)

    def one_pass_generator(self, label: str, max_new_tokens: int, batch_size: int | None = None):
        """The one-pass draft ``label`` (P-EAGLE, DFlash) at the settings' fixed K."""
        import eagle3_jax as e3

        draft, k = self.one_pass[label]
        return e3.Generator(self.target, draft, num_draft_tokens=k,
                            max_len=self.capacity(max_new_tokens, self.settings.num_draft_tokens),
                            batch_size=batch_size)

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
    stats: object             # GenerationStats of the timed passes together (compiles excluded)
    compile_seconds: float    # the untimed first pass: compiles, calibration, first executions
    rates: list[float]        # tok/s of each timed pass
    choice: object = None     # under auto: the DraftChoice after the last timed pass

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(self.rates)


def run_modes(pair: DemoPair, gens: dict, prompt_ids: list[list[int]], temperature: float, seed: int,
              passes: int) -> dict[str, ModeRun]:
    """``prompt_ids`` through each generator of ``gens`` (name -> Generator): one untimed pass each,
    then ``passes`` rounds that run every mode once, in turn, all with the same seed."""
    from eagle3_jax.metrics import GenerationStats

    kw = dict(eos_token_ids=pair.eos, temperature=temperature, seed=seed, prompt_len=pair.prompt_len)
    first = {}
    for name, gen in gens.items():
        t = time.perf_counter()
        gen.generate(prompt_ids, pair.settings.max_new_tokens, **kw)
        first[name] = time.perf_counter() - t
    results = {name: [] for name in gens}
    for _ in range(passes):
        for name, gen in gens.items():
            results[name].append(gen.generate(prompt_ids, pair.settings.max_new_tokens, **kw))
    return {name: ModeRun(res[-1].tokens, GenerationStats.combine([r.stats for r in res]), first[name],
                          [r.stats.tokens_per_second for r in res], gens[name].draft_choice)
            for name, res in results.items()}


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


def ratio(mode: ModeRun, base: ModeRun) -> tuple[float, float, float]:
    """(median, lowest, highest) of a mode's per-pass tok/s over the same pass of the base."""
    r = [a / b for a, b in zip(mode.rates, base.rates)]
    return statistics.median(r), min(r), max(r)


def ratio_text(mode: ModeRun, base: ModeRun) -> str:
    mid, lo, hi = ratio(mode, base)
    return f"{mid:.2f}x" if len(mode.rates) == 1 else f"{mid:.2f}x ({lo:.2f}-{hi:.2f})"


@dataclass
class Case:
    batch_size: int
    temperature: float
    base: ModeRun
    spec: ModeRun
    one_pass: dict = None   # label -> ModeRun of each one-pass draft at its fixed K the demo runs

    def identical(self, label: str | None = None) -> int:
        """Prompts whose tokens equal target-only's: EAGLE-3's, or those of the one-pass draft ``label``."""
        other = self.spec if label is None else self.one_pass[label]
        return sum(a == b for a, b in zip(self.base.tokens, other.tokens))


def table(cases: list[Case], k: int | str, one_pass_k: dict | None = None) -> str:
    def cells(run: ModeRun, base: ModeRun, k_text: str) -> tuple:
        p = run.stats
        return (f"{run.tokens_per_second:.1f}", ratio_text(run, base), k_text, f"{p.mean_accept_length:.2f}",
                " ".join(f"{r:.2f}" for r in p.accept_rate_per_position) or "-")

    rows = [("batch", "T", "target-only tok/s", "EAGLE-3 tok/s", "speedup (range)", "K", "tau",
             "acceptance by draft position", "first pass, s")]
    for c in cases:
        k_text = f"K={k}" if c.spec.choice is None else f"auto K={c.spec.choice.num_draft_tokens}"
        rows.append((f"{c.batch_size}", f"{c.temperature:g}", f"{c.base.tokens_per_second:.1f}",
                     *cells(c.spec, c.base, k_text), f"{c.base.compile_seconds:.0f} / {c.spec.compile_seconds:.0f}"))
        for label, run in (c.one_pass or {}).items():   # each one-pass draft's row under the same case
            rows.append(("", "", f"{label}:", *cells(run, c.base, f"K={(one_pass_k or {}).get(label, '?')}"),
                         f"{run.compile_seconds:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(v.ljust(w) if i == 7 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
                     for r in rows)


def table_notes(passes: int) -> str:
    return (f"  tok/s: the median of {passes} timed passes; speedup: the median of the per-pass ratios to "
            "target-only, (lowest-highest) pass. tau: tokens per verify round, the bonus token included.\n"
            "  first pass, s: the untimed pass before them (target-only / EAGLE-3), which compiles each mode's "
            "programs and, under auto, times its round costs; not in tok/s.")


def why_line(case: Case) -> str | None:
    """Why the EAGLE-3 round pays (or not), from auto's live round timings (None without them)."""
    c = case.spec.choice
    if c is None or not c.num_draft_tokens:
        return None
    k = c.num_draft_tokens
    if k not in c.round_seconds_per_k or not c.target_round_seconds > 0:
        return None
    steps = c.round_seconds_per_k[k] / c.target_round_seconds
    return (f"  auto's estimate (batch {case.batch_size}, T={case.temperature:g}): a K={k} round (draft {k} tokens, "
            f"verify {k + 1}) costs {steps:.2f} target decode steps and emits tau = {c.tau:.2f} tokens per row, "
            f"{c.tau:.2f} / {steps:.2f} = {c.tau / steps:.2f}x predicted; measured {ratio_text(case.spec, case.base)}")


def run(demo_dir: str) -> int:
    import jax

    s = DemoSettings.load(demo_dir)
    t = time.perf_counter()
    pair = DemoPair.load(demo_dir, max(s.num_prompts))
    where = os.path.relpath(demo_dir)
    print(f"eagle3-jax demo: {where}/target + {where}/draft, held-out prompts ({where}/prompts.jsonl), "
          f"{s.max_new_tokens} new tokens each, rows refilled as prompts finish, {s.dtype}", flush=True)
    n_params = sum(x.size for x in jax.tree.leaves(pair.target.state))
    c = pair.target.config
    print(f"loaded in {time.perf_counter() - t:.1f}s: target {n_params / 1e6:.1f}M parameters, "
          f"{c.num_hidden_layers} layers ({c.n_routed_experts} routed experts top-{c.num_experts_per_tok}), "
          f"draft fuses target layers {list(pair.draft.aux_layer_ids)}", flush=True)

    cases = []
    for batch_size, n in zip(s.batch_sizes, s.num_prompts):
        prompt_ids = pair.prompt_ids[:n]
        base_gen = pair.generator(0, s.max_new_tokens, batch_size)
        spec_gen = pair.generator(s.num_draft_tokens, s.max_new_tokens, batch_size)
        gens = {"base": base_gen, "spec": spec_gen} | {
            label: pair.one_pass_generator(label, s.max_new_tokens, batch_size) for label in pair.one_pass}
        for temperature in s.temperatures:
            runs = run_modes(pair, gens, prompt_ids, temperature, s.seed, s.timed_passes)
            base, spec = runs["base"], runs["spec"]
            case = Case(batch_size, temperature, base, spec, {label: runs[label] for label in pair.one_pass})
            cases.append(case)
            also = "".join(f"; {label} {r.tokens_per_second:.1f} tok/s, {ratio_text(r, base)}"
                           for label, r in case.one_pass.items())
            print(f"batch {batch_size:>2} ({n} prompts), T={temperature:g}: target-only "
                  f"{base.tokens_per_second:.1f} tok/s; EAGLE-3 {spec.tokens_per_second:.1f} tok/s, "
                  f"{ratio_text(spec, base)}{also}", flush=True)
            checked = {"EAGLE-3": case.identical()} | {label: case.identical(label) for label in case.one_pass}
            for name, same in checked.items():
                if temperature == 0 and same != n:
                    print(f"error: batch {batch_size}, greedy: speculative decoding ({name}) changed the output "
                          f"of {n - same} of {n} prompts; this is a bug, please report it")
                    return 1
        # One process holding every batch size's programs runs out of memory mappings at Linux's
        # default vm.max_map_count, so they are dropped before the next batch size compiles.
        del base_gen, spec_gen, gens
        jax.clear_caches()
        gc.collect()

    greedy = next((c for c in cases if c.temperature == 0), cases[0])
    print()
    for p, toks in list(zip(pair.prompts, greedy.spec.tokens))[:SHOWN_COMPLETIONS]:
        print(f"[{p['id']}]")
        print(show_completion(pair.tokenizer, p["prompt"], toks, pair.eos))
        print()
    print(f"Measured here, this run ({s.timed_passes} timed passes per case; {jax.default_backend()}, "
          f"{jax.device_count()} device(s), {os.cpu_count()} CPU cores):")
    print(table(cases, s.num_draft_tokens, {label: k for label, (_, k) in pair.one_pass.items()}))
    print(table_notes(s.timed_passes))
    for case in cases:
        if case.temperature == 0:
            also = "".join(f" ({label}: {case.identical(label)}/{len(case.base.tokens)})" for label in case.one_pass)
            print(f"  identical tokens at batch {case.batch_size}, greedy (lossless): "
                  f"{case.identical()}/{len(case.base.tokens)} prompts{also}")
    for case in cases:
        if (line := why_line(case)):
            print(line)
    print("  These figures vary with the machine and its load; README.md's results table is `make bench` "
          "(8 prompts x 64 tokens, 3 paired passes), with the machine, commit and date it ran on.")
    return 0
