"""A loaded draft bound to its target (``LoadedDraft``), and the wiring check every draft loader
runs before it places a weight. A leaf below ``api`` so that draft loaders of every kind
(``checkpoint.peagle_map``) use it without importing the facade."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.sharding import mesh_context


@dataclass
class DraftOutput:
    logits: jax.Array   # [B, T, draft_vocab] float32
    hidden: jax.Array   # [B, T, D]


def _draft_call(graphdef, state, ids_BT, aux_BTX, embed_VD):
    draft = nnx.merge(graphdef, state)
    B, T = ids_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    step = draft(ids_BT, draft.fuse(aux_BTX), positions_BT, embed_VD, None)
    return step.logits_BTW, step.hidden_BTD


class LoadedDraft:
    """An EAGLE-3 draft checked against, and wired to, its target (an ``api.LoadedTarget``)."""

    def __init__(self, model: Draft, target, aux_layer_ids: tuple[int, ...]):
        self.model = model
        self.config: DraftConfig = model.cfg
        self.target = target
        self.aux_layer_ids = aux_layer_ids
        self.graphdef, self.state = nnx.split(model)
        self._call = jax.jit(_draft_call, static_argnums=(0,))

    def forward(self, ids, aux_hidden) -> DraftOutput:
        """One causal pass (TTT step 0). ``ids[:, t]`` is the token after position t of ``aux_hidden``."""
        with mesh_context(self.target.mesh):
            logits, hidden = self._call(self.graphdef, self.state, jnp.asarray(ids, jnp.int32),
                                        jnp.asarray(aux_hidden), self.target.model.embed_tokens.value)
        return DraftOutput(logits=logits, hidden=hidden)


def check_and_wire(cfg: DraftConfig, target, fc_in: int, d2t, own_embedding_width):
    """The draft's aux layer ids for ``target``, after every wiring contract is checked
    (``contracts.check_pairing``)."""
    ids = resolve_aux_ids(cfg, target.config)
    check_pairing(cfg, target.config, fc_in, len(ids), d2t, own_embedding_width)
    return ids
