"""The training loop for ``draft_kind: peagle``: the Trainer with a P-EAGLE draft, COD-sampled
rollouts added to each batch, and SpecForge's P-EAGLE loss.

The draft starts from the target's token embedding and trains it, as SpecForge does; the other
weights start random. The export is SpecForge's ``PEagleDraftModel`` layout with the aux ids and the
MASK token id it was trained with.

Pairing. The trainer's rows are the target's view: token x_t, its aux states aux[t] and final
hidden state at t (logits[t] guess x_{t+1}). drafts/peagle/objective.py reads rows in SpecForge's shifted
capture: position t carries ids[t] = x_{t+1}, aux[t], target[t] = logits[t+1]. The shift keeps T
positions, the last one filled as SpecForge's padding does (id 0, zero logits: a uniform label).
Which positions count (``loss_convention``, as for EAGLE-3):
  ours       position t predicts x_{t+2}: it counts when x_{t+2} is a loss token (loss_mask[t+2]);
             the batch's loss is the weighted mean over all its rows' sampled tokens;
  specforge  loss_mask[t] as SpecForge passes it, unshifted beside the shifted ids and logits, the
             row's last position labelled by the zero row its shift appends (a padded row's next
             position holds the padding's logits, replaced here); each row's weighted mean, the
             rows averaged (SpecForge trains one row a device and averages the devices' losses).
The same mask decides which positions COD sampling (on the host: step.host_draws) may extend
rollouts into.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax.config import resolve_dtype
from eagle3_jax.drafts.peagle.model import PEagleDraft
from eagle3_jax.drafts.peagle.objective import CODSettings, cod_budget, cod_sample, pad_rollouts, peagle_loss
from eagle3_jax.drafts.peagle.training import resolve_mask_token_id
from eagle3_jax.train.progress import info as _info
from eagle3_jax.train.step import OptimizerSpec, optimizer_step
from eagle3_jax.train.trainer import Trainer
from eagle3_jax.train.ttt import target_logits


@dataclass(frozen=True)
class PEagleSpec:
    """What one P-EAGLE step computes; hashable (the compiled step depends on it)."""

    cod: CODSettings
    convention: str = "ours"
    target_chunk: int | None = None

    @classmethod
    def from_config(cls, cfg) -> "PEagleSpec":
        s = cfg.peagle
        return cls(CODSettings(s.num_depths, s.down_sample_ratio, s.down_sample_ratio_min), cfg.loss_convention,
                   cfg.target_chunk)


def shifted_loss_mask(loss_mask_BT, convention: str):
    """The loss mask of the shifted rows (module docstring); numpy or jax arrays alike."""
    if convention == "specforge":
        return loss_mask_BT
    xp = jnp if isinstance(loss_mask_BT, jax.Array) else np
    return xp.concatenate([loss_mask_BT[:, 2:], xp.zeros_like(loss_mask_BT[:, :2])], axis=1)


def _shift_left(x_BT_):
    """x[:, t] <- x[:, t + 1]; zeros at the last position."""
    return jnp.concatenate([x_BT_[:, 1:], jnp.zeros_like(x_BT_[:, :1])], axis=1)


def shifted_rows(mb, aux_BTX, hidden_BTD, lm_head_DV, convention: str) -> tuple:
    """peagle_loss's row arguments (ids, aux, target logits, loss mask, anchor, depth, valid) of a
    micro-batch in SpecForge's shifted pairing (module docstring)."""
    target_BTV = _shift_left(target_logits(hidden_BTD, lm_head_DV))
    if convention == "specforge":   # SpecForge's row ends at its length: its zero row, then nothing
        past_BT = jnp.arange(target_BTV.shape[1])[None, :] >= mb["length"][:, None] - 1
        target_BTV = jnp.where(past_BT[..., None], 0.0, target_BTV)
    return (_shift_left(mb["ids"]), aux_BTX, target_BTV, shifted_loss_mask(mb["loss_mask"], convention),
            mb["anchor"], mb["depth"], mb["valid"])


def draw_rollouts(loss_mask_T: np.ndarray, spec: PEagleSpec, rng: np.random.Generator) -> dict:
    """{anchor, depth, valid} [P] of a row's COD-sampled rollouts (the trainer's ``draw_row``)."""
    mask_T = shifted_loss_mask(loss_mask_T[None], spec.convention)[0]
    anchor, depth, valid = pad_rollouts(*cod_sample(mask_T, spec.cod, rng), cod_budget(len(mask_T), spec.cod))
    return {"anchor": anchor.astype(np.int32), "depth": depth.astype(np.int32), "valid": valid}


def peagle_train_step(params, opt_state, rest, lm_head_DV, tstate, batch, lr, *, graphdef, tgraph,
                      opt_spec: OptimizerSpec, aux_ids, spec: PEagleSpec):
    """The P-EAGLE optimizer step; the batch carries ``anchor`` / ``depth`` / ``valid`` from draw_rollouts."""

    def objective(p, mb, aux_BTX, hidden_BTD):
        rows = shifted_rows(mb, aux_BTX, hidden_BTD, lm_head_DV, spec.convention)
        return peagle_loss(nnx.merge(graphdef, p, rest), *rows, num_depths=spec.cod.num_depths,
                           row_means=spec.convention == "specforge")

    return optimizer_step(objective, params, opt_state, tstate, batch, lr, tgraph, opt_spec, aux_ids, spec.target_chunk)


class PEagleTrainer(Trainer):
    train_step = staticmethod(peagle_train_step)
    STEP_HEAD = ("lm_head_DV",)   # the draft holds its own copy of the embedding
    step_spec = staticmethod(PEagleSpec.from_config)
    draw_row = staticmethod(draw_rollouts)

    def _new_draft(self) -> PEagleDraft:
        cfg = self.cfg
        mask_id, source = resolve_mask_token_id(self.dcfg, self.mask_tokenizer())
        self.dcfg = dataclasses.replace(self.dcfg, mask_token_id=mask_id)
        _info("P-EAGLE draft: %d layers, MASK token id %d (%s)", self.dcfg.num_hidden_layers, mask_id, source)
        model = PEagleDraft(self.dcfg, len(self.aux_ids), resolve_dtype(cfg.dtype), nnx.Rngs(cfg.seed))
        # A copy: the step donates the draft's params, and this buffer is also the target's embedding.
        model.embed_tokens[...] = jnp.array(self.embed_VD, model.dtype, copy=True)
        return model

    def run_step(self, batch: dict) -> dict:
        m, lr = self.apply_step(batch)
        total = np.asarray(m["acc_total"], np.int64)
        # acc[d]: top-1 agreement with the target at depth d of the sampled rollouts; count[d]: how many
        return {"step": self.step, "loss": float(m["loss"]),
                "acc": [float(x) for x in np.asarray(m["acc_sum"]) / np.maximum(total, 1)],
                "count": [int(x) for x in total], "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
