"""Which target layers should this draft read? Measured, not guessed.

Drafts ship their aux-layer ids under two conventions ("output of layer i" vs "input of layer i")
and engines fall back to different default layers when a config is silent. A draft wired to the
wrong ids of the right count loads fine and only accepts less. The doctor loads the target and the
draft once, then re-wires the same draft weights to each plausible set of ids and measures greedy
acceptance on a few prompts: the configured ids, each shifted by -1 and +1, and the SGLang and vLLM
defaults. Greedy decoding is lossless, so every wiring generates the same tokens; only how many
of them the draft guessed differs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from eagle3_jax import preflight
from eagle3_jax.metrics import WATCHDOG_TAU

# A wiring must beat the configured one by more than this (tau), and by more than NOISE_SE standard
# errors of the gain measured prompt by prompt, to be recommended: tau moves by tenths from prompt
# to prompt, so two prompts cannot tell a one-layer shift from luck.
MIN_GAIN = 0.05
NOISE_SE = 2.0
# Below this share of the text's tokens in the draft vocab, the vocab map is a likely culprit.
LOW_COVERAGE = 0.8
# --data rows are read up to this many tokens (the draft's accuracies on them: a training step's work)
DATA_MAX_LEN = 2048

BUILTIN_PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n",
    "The three primary colors of light are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Speculative decoding speeds up generation because",
    "    async def __aenter__(self):\n        self._entered = True\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "Once upon a time, in a small village by the sea,",
)


@dataclass
class Wiring:
    name: str                      # "configured", "configured +1", "SGLang default", ... (joined when equal)
    ids: tuple[int, ...]
    skipped: str | None = None     # why it was not measured
    tau: float | None = None
    accept_rate_per_position: list[float] = field(default_factory=list)
    rounds: int = 0
    per_prompt_tau: list[float] = field(default_factory=list)


def gain_and_noise(better: Wiring, than: Wiring) -> tuple[float, float]:
    """How much more ``better`` accepts than ``than`` (tau), and the standard error of that gain.
    Every wiring decodes the same prompts to the same tokens (greedy is lossless), so the gain is
    paired prompt by prompt: its standard error is that of the mean per-prompt difference. Under 3
    prompts there is no spread to judge by: the error is infinite and nothing is recommended."""
    d = np.asarray(better.per_prompt_tau, np.float64) - np.asarray(than.per_prompt_tau, np.float64)
    d = d[np.isfinite(d)]            # a prompt that ended before its first round has no tau
    if d.size < 3:
        return better.tau - than.tau, float("inf")
    return better.tau - than.tau, float(d.std(ddof=1) / np.sqrt(d.size))


def clear_gain(better: Wiring, than: Wiring) -> bool:
    """Whether ``better`` accepts measurably more than ``than``: by MIN_GAIN and beyond the noise."""
    gain, se = gain_and_noise(better, than)
    return gain > max(MIN_GAIN, NOISE_SE * se)


def candidate_wirings(configured: tuple[int, ...], num_layers: int, num_aux: int) -> list[Wiring]:
    """The configured ids first, then the alternatives in use; equal id lists are merged."""
    L = num_layers
    raw = [("configured", tuple(configured)),
           ("configured -1", tuple(i - 1 for i in configured)),
           ("configured +1", tuple(i + 1 for i in configured)),
           ("SGLang default", (1, L // 2 - 1, L - 4)),
           ("vLLM default", (2, L // 2, L - 3))]
    out: list[Wiring] = []
    for name, ids in raw:
        same = next((w for w in out if w.ids == ids), None)
        if same is not None:
            same.name += f" = {name}"
            continue
        skipped = None
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            skipped = f"ids {bad} outside the target's layers 0..{L - 1}"
        elif len(ids) != num_aux:
            skipped = f"{len(ids)} ids, but fc fuses {num_aux} layers"
        out.append(Wiring(name, ids, skipped))
    return out


@dataclass
class DoctorReport:
    target: str
    draft: str
    target_dtype: str | None
    draft_dtype: str | None
    compute_dtype: str
    quantization: str | None
    num_layers: int
    configured_ids: list[int]
    notes: list[str]
    num_prompts: int
    num_draft_tokens: int
    max_new_tokens: int
    wirings: list[Wiring]
    best: str
    best_ids: list[int]
    configured_is_best: bool
    vocab_coverage: float
    tau_near_one: bool
    likely_causes: list[str]
    simulated_acc_len: float | None = None   # with --data: what the draft's accuracies on it imply
    acceptance_gap: str | None = None        # with --data: why tau falls far below that, else None
    within_noise: str | None = None          # a wiring measured higher, but not beyond the noise: which

    @property
    def fix_json(self) -> str:
        return json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": self.best_ids,
                                            "use_aux_hidden_state": True}})

    def verdict(self) -> str:
        if self.configured_is_best and self.within_noise:
            return (f"configured wiring kept: {self.configured_ids}; {self.within_noise}")
        if self.configured_is_best:
            return f"configured wiring is best: {self.configured_ids}"
        return (f"use {self.best} {self.best_ids}: set `eagle_config.eagle_aux_hidden_state_layer_ids` to "
                f"{self.best_ids} in {os.path.join(self.draft, 'config.json')}:\n    {self.fix_json}")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict()
        d["fix_json"] = None if self.configured_is_best else json.loads(self.fix_json)
        return d


def load_prompts(tokenizer, path: str | None, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` prompts: a JSONL file (serve.py's format) or the built-ins."""
    from eagle3_jax.errors import ConfigError
    from eagle3_jax.serve.inputs import read_prompts

    if path is None:   # each at most once: a repeated prompt would count twice as evidence
        texts = list(BUILTIN_PROMPTS[:num_prompts])
        return [tokenizer.encode(t) for t in texts]
    records, bad = read_prompts(path)
    if bad:
        raise ConfigError(f"{path}: {len(bad)} malformed line(s), first: {bad[0]}")
    ids = [tokenizer.encode_chat(r.messages) if r.messages is not None else tokenizer.encode(r.prompt)
           for r in records[:num_prompts]]
    ids = [p for p in ids if p]
    if not ids:
        raise ConfigError(f"{path}: no non-empty prompts")
    return ids


def rank_causes(wirings: list[Wiring], configured_tau: float, coverage: float, compute_dtype: str,
                draft_dtype: str | None) -> list[str]:
    """Likely causes of a low tau, the best-supported first, each with the evidence for it."""
    measured = [w for w in wirings if w.tau is not None]
    best = max(measured, key=lambda w: w.tau)
    causes: list[tuple[float, str]] = []
    if clear_gain(best, wirings[0]):
        causes.append((3.0, f"wrong aux layer ids: {best.name} {list(best.ids)} reaches tau {best.tau:.2f} "
                            f"against {configured_tau:.2f} configured"))
    if coverage < LOW_COVERAGE:
        causes.append((2.0 + (LOW_COVERAGE - coverage), f"draft vocab covers only {coverage:.0%} of the text's target "
                                                        "tokens: a vocab map (d2t) built for another tokenizer or domain"))
    if all(w.tau < WATCHDOG_TAU for w in measured):
        causes.append((2.5, "no wiring gets tokens accepted: the draft is untrained, corrupt, or trained for "
                            "another target (same shapes, different weights)"))
    else:
        causes.append((1.0, "the draft was trained on other data than these prompts (try --prompts with "
                            "your own traffic)"))
    if draft_dtype and draft_dtype != compute_dtype:
        causes.append((0.5, f"draft trained in {draft_dtype}, measured in {compute_dtype}: small differences "
                            "only, rarely the cause"))
    return [text for _, text in sorted(causes, key=lambda c: -c[0])]


def diagnose(target_dir: str, draft_dir: str, prompts: str | None = None, num_prompts: int = 6,
             num_draft_tokens: int = 4, max_new_tokens: int = 48, dtype: str = "float32", mesh=None,
             progress=None, data: str | None = None) -> DoctorReport:
    """Static checks, then greedy acceptance of every plausible wiring of the draft's weights; with
    ``data``, the train/serve gate too (eagle3_jax.train_serve): its rendering, then tau on its
    prompts against the acceptance its per-step accuracies imply."""
    import eagle3_jax as e3
    from eagle3_jax.drafts import LoadedDraft
    from eagle3_jax.speculative.session import PROMPT_BUCKET
    from eagle3_jax.tokenizer import load_tokenizer

    say = progress or (lambda msg: None)
    facts = preflight.check_pair(target_dir, draft_dir, mesh=mesh, dtype=dtype)
    tcfg = facts.target
    say(f"static checks passed: fc fuses {facts.num_aux_layers} layers of width {tcfg.hidden_size}, "
        f"configured ids {list(facts.aux_layer_ids)}")
    tok = load_tokenizer(target_dir)
    if data is not None:
        from eagle3_jax import train_serve
        from eagle3_jax.errors import ConfigError
        from eagle3_jax.train.data import read_examples

        say(f"data rendering agrees with serve.py's ({train_serve.check_rendering(data, tok)} chat records checked)")
        examples = read_examples(data, tok, max_len=DATA_MAX_LEN, vocab_size=tcfg.vocab_size)
        if prompts is None and not train_serve.answer_prompts(examples):
            raise ConfigError(f"{data}: no row has an answer (a loss span after its first token) to prompt with")
    prompt_ids = (load_prompts(tok, prompts, num_prompts) if data is None or prompts is not None
                  else train_serve.answer_prompts(examples)[:num_prompts])
    prompt_len = -(-max(len(p) for p in prompt_ids) // PROMPT_BUCKET) * PROMPT_BUCKET
    max_len = prompt_len + max_new_tokens + num_draft_tokens + 2

    say(f"loading target {target_dir} ({dtype})")
    target = e3.load_target(target_dir, dtype=dtype, mesh=mesh, config=tcfg)
    say(f"loading draft {draft_dir}")
    draft = e3.load_draft(draft_dir, target, checked=facts)
    wirings = candidate_wirings(draft.aux_layer_ids, tcfg.num_hidden_layers, facts.num_aux_layers)
    generated: list[list[int]] = []
    for w in wirings:
        if w.skipped:
            continue
        say(f"measuring {w.name} {list(w.ids)}")
        rewired = LoadedDraft(draft.model, target, w.ids)   # the same weights, other target layers
        gen = e3.Generator(target, rewired, num_draft_tokens=num_draft_tokens, max_len=max_len)
        result = gen.generate(prompt_ids, max_new_tokens, eos_token_ids=tuple(tok.eos_token_ids),
                              prompt_len=prompt_len)
        w.tau = float(result.stats.mean_accept_length)
        w.accept_rate_per_position = [float(a) for a in result.stats.accept_rate_per_position]
        w.rounds = result.stats.rounds
        w.per_prompt_tau = [float(x) for x in result.stats.per_row_accept_length]
        generated = generated or result.tokens

    configured = wirings[0]
    measured = [w for w in wirings if w.tau is not None]
    best = max(measured, key=lambda w: w.tau)
    configured_is_best = best is configured or not clear_gain(best, configured)
    within_noise = None
    if configured_is_best and best is not configured and best.tau > configured.tau:
        _, se = gain_and_noise(best, configured)
        noise = (f"standard error of the per-prompt gain {se:.2f}" if np.isfinite(se)
                 else "under 3 prompts, no spread to judge by")
        within_noise = (f"{best.name} {list(best.ids)} measured tau {best.tau:.2f} against {configured.tau:.2f}, "
                        f"within the noise of {len(prompt_ids)} prompts ({noise}); pass a larger --num-prompts "
                        "to tell them apart")
    if configured_is_best:
        best = configured
    t2d_V = np.asarray(draft.model.t2d[...])
    text_ids = np.asarray([t for seq in prompt_ids + generated for t in seq], np.int64)
    coverage = float(t2d_V[text_ids].mean()) if text_ids.size else float("nan")
    near_one = configured.tau < WATCHDOG_TAU
    causes = rank_causes(wirings, configured.tau, coverage, dtype, facts.draft_dtype) if near_one else []
    simulated = gap = None
    if data is not None:
        from eagle3_jax.train.ttt import simulated_acc_len

        say("measuring the draft's per-step accuracy on the data (teacher-forced, as training does)")
        accs = train_serve.data_accuracies(target, draft.model, draft.aux_layer_ids, examples, num_draft_tokens)
        simulated = simulated_acc_len(accs)
        try:
            train_serve.check_served_acceptance(configured.tau, simulated, num_draft_tokens, where=data)
        except train_serve.ServedAcceptanceGap as e:
            gap = str(e)
    return DoctorReport(
        target=os.fspath(target_dir), draft=os.fspath(draft_dir), target_dtype=facts.target_dtype,
        draft_dtype=facts.draft_dtype, compute_dtype=dtype, quantization=facts.quantization,
        num_layers=tcfg.num_hidden_layers, configured_ids=list(configured.ids), notes=facts.notes,
        num_prompts=len(prompt_ids), num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens,
        wirings=wirings, best=best.name, best_ids=list(best.ids), configured_is_best=configured_is_best,
        vocab_coverage=coverage, tau_near_one=near_one, likely_causes=causes, simulated_acc_len=simulated,
        acceptance_gap=gap, within_noise=within_noise)


def format_report(r: DoctorReport) -> str:
    K = r.num_draft_tokens
    head = f"{'wiring':<34} {'aux ids':<14} {'tau':>6}  " + " ".join(f"{'a' + str(i + 1):>5}" for i in range(K))
    lines = [
        f"target  {r.target}  ({r.num_layers} layers, torch_dtype {r.target_dtype}, "
        f"{r.quantization or 'unquantized'})",
        f"draft   {r.draft}  (torch_dtype {r.draft_dtype}; measured in {r.compute_dtype})",
        f"prompts {r.num_prompts}, {r.max_new_tokens} new tokens each, greedy, K = {K} draft tokens per round",
        *(f"note    {n}" for n in r.notes),
        "",
        head,
        "-" * len(head),
    ]
    for w in r.wirings:
        ids = str(list(w.ids))
        if w.skipped:
            lines.append(f"{w.name:<34} {ids:<14} {'-':>6}  skipped: {w.skipped}")
        else:
            rates = " ".join(f"{a:5.2f}" for a in w.accept_rate_per_position)
            mark = "  <- best" if w.name == r.best else ""
            lines.append(f"{w.name:<34} {ids:<14} {w.tau:6.2f}  {rates}{mark}")
    lines += [
        "",
        "tau = tokens per verify round incl. the bonus token; aN = share of rounds whose draft token N was accepted",
        f"draft vocab coverage: {r.vocab_coverage:.1%} of the target tokens in the prompts and generations",
        f"tau near 1.0 (the collapse symptom): {'YES' if r.tau_near_one else 'no'}",
    ]
    if r.simulated_acc_len is not None:
        lines.append(f"on the data: tau {r.wirings[0].tau:.2f} served vs 1 + {r.simulated_acc_len:.2f} implied by the "
                     f"draft's per-step accuracies: {'GAP' if r.acceptance_gap else 'consistent'}")
    if r.acceptance_gap:
        lines.append(r.acceptance_gap)
    if r.likely_causes:
        lines.append("likely causes, most likely first:")
        lines += [f"  {i + 1}. {c}" for i, c in enumerate(r.likely_causes)]
    lines += ["", "verdict: " + r.verdict()]
    return "\n".join(lines)
