"""Does the sampler leave acceptance on the table? The loop's K = 1 acceptance against its expectation.

At temperature T > 0, a round of a row whose target cache holds positions 0..n-1 (``last`` = the
token at n; positions as in ``generate.py``) drafts d1 ~ q, the draft's softmax(logits / T) from its
output at position n-1 (input: the token at n paired with the target's aux state at n-1), and
accepts it with probability min(1, p(d1) / q(d1)), p the target's filtered distribution at n. So
P(accept | context) = sum_x min(p(x), q(x)), the overlap of p and q. Teacher forcing a row's prompt
and emitted tokens through the target (with the draft's aux layers) and the draft gives p and q at
every position, so the loop's count of acceptances can be set against the sum of the overlaps of
the rounds it ran. Rejecting more often than that wastes draft tokens; accepting more often breaks
losslessness. Both show up as a gap of many standard errors.

Which contexts the rounds ran on depends on earlier acceptances, and a run reports per row only its
round count and mean acceptance length. With ``MAX_NEW_TOKENS`` = 3 they pin the rounds exactly:
the prefill emits the first token; round 1 runs at n = prompt length; it accepts (two tokens, the
row is done: acceptance length 2) or emits a correction, and then round 2 runs at n + 1 (its two
tokens cut to the one left in the budget: acceptance length 1). Round 2's q comes from the
catch-up pass, so both the prefill's and the catch-up's draft outputs are checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.speculative.accept import target_probs

MAX_NEW_TOKENS = 3
_BUCKET = 16   # sequence lengths are padded up to a multiple of this, so forwards share compilations


@dataclass(frozen=True)
class Comparison:
    """The loop's acceptance count over ``rounds`` K = 1 rounds against its expectation."""

    rounds: int
    accepted: int       # what the loop counted
    expected: float     # sum over the same rounds of the overlap of p and q
    variance: float     # sum of a(1 - a): the count's variance when each round accepts with its overlap a

    @property
    def measured_rate(self) -> float:
        return self.accepted / self.rounds

    @property
    def expected_rate(self) -> float:
        return self.expected / self.rounds

    @property
    def stderr(self) -> float:
        """Binomial standard error of the measured rate."""
        r = self.measured_rate
        return math.sqrt(r * (1 - r) / self.rounds)

    @property
    def z(self) -> float:
        """(measured - expected) in standard deviations of the count under the expectation."""
        return (self.accepted - self.expected) / math.sqrt(max(self.variance, 1e-12))


def round_starts(prompt_len: int, tokens: Sequence[int], accept_length: float, eos: Sequence[int]) -> list[int]:
    """The positions n at which one row's rounds ran, for a K = 1 run of ``MAX_NEW_TOKENS`` new tokens.

    ``tokens``: the row's emitted tokens; ``accept_length``: its round tokens per round (the run's
    ``stats.per_row_accept_length`` entry)."""
    if len(tokens) == 1:            # the first token was EOS: no round
        return []
    if accept_length == 2.0 or (len(tokens) == 2 and tokens[-1] in eos):   # one round, then done
        return [prompt_len]
    if len(tokens) == MAX_NEW_TOKENS:
        return [prompt_len, prompt_len + 1]
    raise ValueError(f"a row of {len(tokens)} tokens (acceptance length {accept_length}) does not fit a K = 1 run "
                     f"of {MAX_NEW_TOKENS} new tokens; was the cache capacity too small?")


def overlaps(target, draft, sequences: Sequence[Sequence[int]], starts: Sequence[Sequence[int]], temperature: float,
             top_p: float = 1.0, top_k: int = 0, rows_per_call: int = 64) -> np.ndarray:
    """sum_x min(p(x), q(x)) of every round, teacher-forced: ``sequences[i]`` is a row's prompt and
    emitted tokens, ``starts[i]`` the positions n of its rounds. ``target``/``draft``: a LoadedTarget
    and its LoadedDraft. Returns float64 [total rounds], row by row."""
    to_target_W = draft.model.to_target_ids(jnp.arange(draft.config.draft_vocab_size))
    out = []
    rows = [(list(s)[:max(n) + 1], list(n)) for s, n in zip(sequences, starts) if n]
    for i in range(0, len(rows), rows_per_call):
        chunk = rows[i:i + rows_per_call]
        T = -(-max(len(s) for s, _ in chunk) // _BUCKET) * _BUCKET
        ids_BT = np.zeros((rows_per_call, T), np.int32)   # fixed shape: one compilation per T
        for b, (s, _) in enumerate(chunk):
            ids_BT[b, :len(s)] = s
        fwd = target.forward(ids_BT, draft.aux_layer_ids)
        # The draft's input at position t pairs the token at t + 1 with the aux state at t.
        shifted_BT = np.concatenate([ids_BT[:, 1:], np.zeros((rows_per_call, 1), np.int32)], axis=1)
        dlogits_BTW = draft.forward(shifted_BT, fwd.aux_hidden).logits
        row_R = np.array([b for b, (_, ns) in enumerate(chunk) for _ in ns])
        n_R = np.array([n for _, ns in chunk for n in ns])
        R = len(n_R)
        pad = -R % rows_per_call   # padded with copies of row 0's first round: few distinct shapes to compile
        row_R, n_R = np.pad(row_R, (0, pad), mode="edge"), np.pad(n_R, (0, pad), mode="edge")
        a_R = _overlap(fwd.logits[row_R, n_R], dlogits_BTW[row_R, n_R - 1], to_target_W, temperature, top_k, top_p)
        out.append(np.asarray(a_R, np.float64)[:R])
    return np.concatenate(out) if out else np.zeros((0,))


@jax.jit
def _overlap(logits_RV, dlogits_RW, to_target_W, temperature, top_k, top_p):
    p_RV = target_probs(logits_RV, temperature, top_k, top_p)
    # q as the loop samples d1: softmax over the draft vocab (temperature only), at target ids.
    q_RW = jax.nn.softmax(dlogits_RW / jnp.maximum(temperature, 1e-6), axis=-1)
    q_RV = jnp.zeros_like(p_RV).at[:, to_target_W].set(q_RW)
    return jnp.minimum(p_RV, q_RV).sum(-1)


def compare(gen, prompts: Sequence[Sequence[int]], seeds: Sequence[int], temperature: float = 1.0,
            top_p: float = 1.0, top_k: int = 0, eos: Sequence[int] = ()) -> Comparison:
    """Runs ``gen`` (a K = 1 ``Generator`` with a draft) on ``prompts`` once per seed for
    ``MAX_NEW_TOKENS`` new tokens, and sets its acceptance count against the expectation on the
    very contexts its rounds ran on."""
    if gen.draft is None or gen.num_draft_tokens != 1:
        raise ValueError(f"the check needs a K = 1 Generator with a draft, found K = {gen.num_draft_tokens}")
    if temperature <= 0:
        raise ValueError(f"the check needs temperature > 0 (greedy rounds accept deterministically), "
                         f"found {temperature}")
    rounds = accepted = 0
    sequences, starts = [], []
    for seed in seeds:
        res = gen.generate(prompts, MAX_NEW_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           eos_token_ids=eos)
        for p, toks, tau in zip(prompts, res.tokens, res.stats.per_row_accept_length):
            sequences.append(list(p) + toks)
            starts.append(round_starts(len(p), toks, tau, eos))
        rounds += res.stats.rounds
        accepted += res.stats.accepted_per_position[0]
    if sum(map(len, starts)) != rounds:
        raise RuntimeError(f"reconstructed {sum(map(len, starts))} rounds from the rows, the run counted {rounds}")
    a_R = overlaps(gen.target, gen.draft, sequences, starts, temperature, top_p, top_k)
    return Comparison(rounds, accepted, float(a_R.sum()), float((a_R * (1 - a_R)).sum()))
