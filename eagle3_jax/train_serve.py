"""The gate between training and serving: a draft with high training accuracy and tau near 1 when
served is the common failure when the two disagree (the chat template, the generation prompt, a
thinking prefix, stop tokens, where the loss mask falls). ``check_rendering`` compares the data's
rendering with serve.py's before any weight loads; ``check_served_acceptance`` the served tau with
what the training accuracies imply, at each eval; ``ContextBuckets`` splits tau by context length.
``python -m tools.doctor --target T --draft D --data DATA.jsonl`` runs the first two on a finished draft.
"""

from __future__ import annotations

import itertools
import logging
import math

from eagle3_jax.errors import ConfigError, Eagle3Error

log = logging.getLogger("eagle3_jax")

# A data file is rendered by one tool in one way: its first records say how.
RECORDS_CHECKED = 256
# The eval's floor (config: eval_min_accept_share), checked once the accuracies imply MIN_SIMULATED.
MIN_ACCEPT_SHARE = 0.25
MIN_SIMULATED = 0.5
CONTEXT_BUCKETS = ((2048, "<2k"), (8192, "2k-8k"), (32768, "8k-32k"), (math.inf, ">=32k"))


class RenderingMismatch(ConfigError):
    """Training data rendered otherwise than serve.py renders the same conversation."""


class ServedAcceptanceGap(Eagle3Error):
    """The draft accepts far less when served than its training accuracies imply."""


# ---------------------------------------------------------------------- rendering, before training
def template_markers(tok) -> tuple[list[int], list[int]]:
    """(the tokens the chat template opens a user turn with, the tokens it appends for the answer
    with ``add_generation_prompt``: what serve.py's prompts end with). Empty without a template."""
    if getattr(tok, "chat_template", None) is None:
        return [], []
    probe = [{"role": "user", "content": "Q"}]
    text = tok.render_chat(probe, add_generation_prompt=False)
    opening = text[:text.find("Q")]
    bos = tok.template_variables().get("bos_token")
    opening = opening[len(bos):] if bos and opening.startswith(bos) else opening
    without = tok.encode(text, add_special_tokens=False)
    with_prompt = tok.encode(tok.render_chat(probe, add_generation_prompt=True), add_special_tokens=False)
    gen = with_prompt[_first_difference(without, with_prompt) or len(without):]
    return tok.encode(opening, add_special_tokens=False) if opening else [], gen


def check_rendering(path: str, tok, records: int = RECORDS_CHECKED) -> int:
    """Checks the first ``records`` records of a training file; returns how many carried a chat.

    ``{"messages"}``: serve's prompt for each assistant turn must begin the conversation as training
    renders it, and ``input_ids`` / ``loss_mask``, if given, must be that rendering exactly.
    ``{"input_ids", "loss_mask"}`` holding this template's user-turn opening: every answer (a loss
    span after position 0) must follow the generation prompt. Other records have nothing to compare."""
    from eagle3_jax.train import data as data_lib

    opening, gen = template_markers(tok)
    checked = 0
    for where, record in itertools.islice(data_lib.iter_jsonl(path), records):
        if not isinstance(record, dict):
            continue   # read_examples names what is wrong with it
        if "messages" in record:
            _check_conversation(where, tok, data_lib.encode_record(tok, {"messages": record["messages"]}, where),
                                record)
        elif (opening and isinstance(record.get("input_ids"), list) and isinstance(record.get("loss_mask"), list)
              and _contains(record["input_ids"], opening)):
            _check_answers(where, tok, record["input_ids"], record["loss_mask"], gen)
        else:
            continue
        checked += 1
    if checked:
        _warn_unstoppable_turn_end(tok)
    return checked


def _contains(seq: list, sub: list) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def _check_conversation(where: str, tok, ours, record: dict) -> None:
    messages, ours_ids = record["messages"], [int(x) for x in ours.ids]
    text = tok.render_chat(messages, add_generation_prompt=False)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not text.startswith(tok.render_chat(messages[:k], add_generation_prompt=True)):
            served = tok.encode_chat(messages[:k])   # exactly serve.py's prompt ids
            raise _mismatch(where, f"serve.py's prompt for assistant turn {k} is not how training renders the "
                                   "conversation up to it (the template renders past turns differently: a "
                                   "thinking block or a generation prompt it drops)", tok, ours_ids, served)
    given = record.get("input_ids")
    if given is None:
        return
    if _first_difference(given, ours_ids) is not None:
        raise _mismatch(where, "its input_ids are not this tokenizer's rendering of its messages (another chat "
                               "template, no generation prompt, or other special tokens)", tok, given, ours_ids)
    mask = record.get("loss_mask")
    if mask is not None:
        j = _first_difference([bool(x) for x in mask], [bool(x) for x in ours.loss_mask])
        if j is not None:
            raise RenderingMismatch(
                f"{where}: its loss mask falls elsewhere than on the answers serve.py's target writes: at token {j} "
                f"({_token(tok, given, j)}) the data says {'loss' if j < len(mask) and mask[j] else 'no loss'}, "
                f"the answers say {'loss' if j < len(ours.loss_mask) and ours.loss_mask[j] else 'no loss'}.\n"
                f"  tokens: {_show(tok, given, j)}\n" + _FIX)


def _check_answers(where: str, tok, ids: list, mask: list, gen: list[int]) -> None:
    for a in range(1, min(len(ids), len(mask))):
        if mask[a] and not mask[a - 1]:   # an answer starts: serve's prompt would end with ``gen`` here
            start = max(a - len(gen), 0)
            served = ids[:start] + gen + ids[a:]
            if _first_difference(ids, served) is not None:
                raise _mismatch(where, f"the answer at token {a} does not follow this template's generation "
                                       f"prompt {tok.decode(gen)!r} (data rendered with another chat template, "
                                       "without the generation prompt, or a loss mask that starts elsewhere)",
                                tok, ids, served)


def _warn_unstoppable_turn_end(tok) -> None:
    """Stop tokens: the template ends an answer with a token serve.py does not stop at."""
    probe = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    prompt, full = tok.render_chat(probe[:1], add_generation_prompt=True), tok.render_chat(probe, False)
    if not full.startswith(prompt + "A"):
        return
    tail = tok.encode(full[len(prompt) + 1:], add_special_tokens=False)
    if tail and tok.eos_token_ids and tail[0] not in tok.eos_token_ids:
        log.warning("the chat template ends an answer with %r (id %d), which is not one of serve.py's stop ids %s: "
                    "served answers run on where the training data's end; add it to generation_config.json's "
                    "eos_token_id if it ends a turn", tok.decode(tail[:1]), tail[0], list(tok.eos_token_ids))


_FIX = ("Render training data as serve.py renders prompts: {\"messages\": [...]} records, which train.py renders "
        "with the target's chat template (`python serve.py ... --emit training` writes them).")


def _first_difference(a, b) -> int | None:
    from eagle3_jax.train.data import _common_prefix

    i = _common_prefix(a, b)
    return None if i == len(a) == len(b) else i


def _token(tok, ids, i: int) -> str:
    return f"id {ids[i]} {tok.decode([ids[i]])!r}" if i < len(ids) else "(its end)"


def _show(tok, ids, i: int, before: int = 24, after: int = 12) -> str:
    head = ("…" if i > before else "") + repr(tok.decode(ids[max(i - before, 0):i]))
    return f"{head} ▸ {tok.decode(ids[i:i + after])!r}" + ("…" if i + after < len(ids) else "")


def _mismatch(where: str, what: str, tok, data_ids, serve_ids) -> RenderingMismatch:
    i = _first_difference(data_ids, serve_ids)
    return RenderingMismatch(
        f"{where}: the data is rendered unlike serve.py renders the same conversation: {what}. First differing "
        f"token, position {i}: the data has {_token(tok, data_ids, i)}, serve.py's rendering "
        f"{_token(tok, serve_ids, i)}.\n  data:  {_show(tok, data_ids, i)}\n  serve: {_show(tok, serve_ids, i)}\n"
        + _FIX)


# ---------------------------------------------------------------------- acceptance, during training
def check_served_acceptance(tau: float, simulated: float | None, num_draft_tokens: int,
                            min_share: float = MIN_ACCEPT_SHARE, where: str = "eval") -> None:
    """Raises ``ServedAcceptanceGap`` when the served draft gets under ``min_share`` of the tokens a
    round accepts by its training accuracies (``simulated``: a0 + a0 a1 + ..., without the bonus token)."""
    if not min_share or simulated is None or not math.isfinite(tau) or simulated < MIN_SIMULATED:
        return
    share = (tau - 1.0) / simulated
    if share >= min_share:
        return
    raise ServedAcceptanceGap(
        f"{where}: the draft's tau through the decode loop is {tau:.2f} at K = {num_draft_tokens}, but its training "
        f"accuracies imply 1 + {simulated:.2f} (SpecForge's simulated acceptance): served, it gets {share:.0%} of the "
        f"tokens it guesses in training (the floor is {min_share:.0%}). Likely causes, most likely first: (1) training "
        "and serving render differently: chat template, generation prompt, a thinking prefix, stop tokens (data "
        "made by another tool; the start-of-training check reads its first records only); (2) the loss mask covers "
        "text the target does not write when served (prompts, system or tool text), which is easy to predict; (3) "
        "the eval prompts are unlike the training data; (4) when served elsewhere: other aux layer ids or another "
        "target than it was trained on (`python -m tools.doctor --target T --draft D --data DATA.jsonl`). To train "
        "on regardless, set eval_min_accept_share=0.")


def data_accuracies(target, draft, aux_ids, examples, steps: int, max_rows: int = 16) -> list[float]:
    """Per-step top-1 accuracy over the loss tokens (training's ``acc_all``) of a draft on data rows."""
    import jax
    from flax import nnx

    from eagle3_jax.train import offline, pipeline, ttt

    source = pipeline.TokenizedSource(examples[:max_rows], max(len(e.ids) for e in examples[:max_rows]))
    batch = pipeline.device_batch([source[i] for i in range(len(source))], None, len(source))
    embed_VD, lm_head_DV = offline.target_head(target.model)
    graphdef, state = nnx.split(draft)

    @jax.jit
    def accuracies(state, tstate, ids_BT, mask_BT, length_B):
        aux, hidden = offline.target_features(target.graphdef, tstate, ids_BT, tuple(aux_ids))
        d = nnx.merge(graphdef, state)
        signal = ttt.target_signal_from_hidden(hidden, lm_head_DV, mask_BT, d.d2t[...], d.t2d[...],
                                               length_B=length_B)
        return ttt.ttt_loss(d, aux, ids_BT, signal, embed_VD, ttt.LossSpec(steps=steps))[1]["acc_all"]

    return [float(a) for a in accuracies(state, target.state, batch["ids"], batch["loss_mask"], batch["length"])]


def answer_prompts(examples) -> list[list[int]]:
    """Each row up to its last answer (the start of its last loss span): what serve.py is asked to continue."""
    out = []
    for e in examples:
        starts = [a for a in range(1, len(e.ids)) if e.loss_mask[a] and not e.loss_mask[a - 1]]
        if starts:
            out.append([int(x) for x in e.ids[:starts[-1]]])
    return out


# ---------------------------------------------------------------------- tau by context length
def context_bucket(tokens: float) -> str:
    return next(label for edge, label in CONTEXT_BUCKETS if tokens < edge)


class ContextBuckets:
    """tau per context-length bucket: a prompt counts, with its verify rounds and the tokens they
    emitted, in the bucket of its mean context while it generates (its prompt plus half its new tokens)."""

    def __init__(self):
        self.totals = {label: [0, 0, 0] for _, label in CONTEXT_BUCKETS}   # prompts, rounds, round tokens

    def add(self, prompt_tokens: int, stats) -> None:
        t = self.totals[context_bucket(prompt_tokens + stats.tokens / 2)]
        t[0], t[1], t[2] = t[0] + 1, t[1] + stats.rounds, t[2] + stats.round_tokens

    def as_dict(self) -> dict:
        return {label: {"prompts": p, "rounds": r, "tau": (n / r if r else None)}
                for label, (p, r, n) in self.totals.items()}


def tau_by_context(items) -> dict:
    """``ContextBuckets`` of (prompt tokens, GenerationStats) pairs, as a dict."""
    buckets = ContextBuckets()
    for prompt_tokens, stats in items:
        buckets.add(prompt_tokens, stats)
    return buckets.as_dict()
