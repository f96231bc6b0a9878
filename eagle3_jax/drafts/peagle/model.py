"""The P-EAGLE draft (parallel EAGLE; SpecForge ``PEagleDraftModel`` compatible).

A stack of ``num_hidden_layers`` Llama decoder layers over EAGLE-3 inputs. Every position carries
a token and a hidden state; the first layer is the EAGLE-3 layer (2D wide), the others are plain:

    hidden  = fc(aux)   at a known position,   fc(mask_hidden)   at a position still to be guessed
    token   = the next token (known),           mask_token_id     (to be guessed)
    layer 0 : x = concat[input_layernorm(embed(token)), hidden_norm(hidden)]
              h = hidden (hidden_norm(hidden) with norm_before_residual) + attn(x); h += mlp(post_ln(h))
    layer i : h = h + attn(input_layernorm(h)); h += mlp(post_ln(h))
    logits  = lm_head(norm(h))   over the draft vocab; target id = id + d2t[id]

``mask_hidden`` replaces the target's aux states (before ``fc``) where they are unknown, so one
pass anchored at position a predicts K positions: depth 0 is the usual EAGLE-3 prediction, depth d
sits at a + d. A query sees the known positions up to its anchor and its own rollout up to its
depth (:func:`rollout_mask`): serving gets that rule from the KV cache, training passes the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.eagle3.model import Buffer, DraftAttention, DraftStep
from eagle3_jax.drafts.peagle.config import PEagleConfig
from eagle3_jax.models.cache import KVCache
from eagle3_jax.models.layers import RMSNorm, SwiGLU, param, rope_cos_sin, rope_inv_freq


def rollout_mask(anchor_BT: jax.Array, depth_BT: jax.Array, doc_BT: jax.Array | None = None) -> jax.Array:
    """[B, T, T] which keys each query may see, for tokens laid out as (anchor position, depth)
    pairs in any order: a depth-0 key whose anchor is at or before the query's anchor, or a key of
    the query's own rollout (same anchor) at or below its depth; never across documents
    (``doc_BT``, -1 = padding, which sees nothing)."""
    qa, ka = anchor_BT[:, :, None], anchor_BT[:, None, :]
    qd, kd = depth_BT[:, :, None], depth_BT[:, None, :]
    seen = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    if doc_BT is not None:
        qdoc = jnp.take_along_axis(doc_BT, anchor_BT, axis=1)
        seen &= (qdoc[:, :, None] == qdoc[:, None, :]) & (qdoc[:, :, None] >= 0)
    return seen


class PEagleLayer(nnx.Module):
    def __init__(self, cfg: PEagleConfig, first: bool, dtype, rngs):
        D = cfg.hidden_size
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        # The first layer normalises the token embedding and the hidden state separately.
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype) if first else None
        self.self_attn = DraftAttention(cfg, dtype, rngs, width=2 * D if first else D)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(D, cfg.intermediate_size, dtype, rngs)

    def __call__(self, emb_BTD, h_BTD, positions_BT, cos, sin, cache, mask_BTT):
        if self.first:
            normed_BTD = self.hidden_norm(h_BTD)
            residual_BTD = normed_BTD if self.norm_before_residual else h_BTD
            x_BTI = jnp.concatenate([self.input_layernorm(emb_BTD), normed_BTD], axis=-1)
        else:
            residual_BTD, x_BTI = h_BTD, self.input_layernorm(h_BTD)
        attn_BTD, cache = self.self_attn(x_BTI, positions_BT, cos, sin, cache, visible_BTS=mask_BTT)
        h_BTD = residual_BTD + attn_BTD
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD)), cache


class PEagleDraft(nnx.Module):
    """The chain draft's calling convention (``Draft``) for known positions, so prefill and catch-up
    are shared, plus :meth:`propose`. Its own token embedding (P-EAGLE trains it) replaces the target's."""

    def __init__(self, cfg: PEagleConfig, n_aux: int, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        D, W, V = cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size
        X = n_aux * cfg.target_hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = param(rngs, (V, D), ("vocab", "embed"), dtype)
        self.fc = param(rngs, (X, D), ("aux", "embed"), dtype)
        # SpecForge initialises it from a unit normal, not the 0.02 of the weights.
        self.mask_hidden = param(rngs, (X,), ("aux",), dtype, std=1.0)
        self.layers = nnx.List([PEagleLayer(cfg, i == 0, dtype, rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head = param(rngs, (D, W), ("embed", "draft_vocab"), dtype)
        self.d2t = Buffer(jnp.zeros((W,), jnp.int32), axes=(None,))
        self.t2d = Buffer(jnp.ones((V,), jnp.bool_) if W == V else jnp.zeros((V,), jnp.bool_), axes=(None,))
        inv_freq, attn_factor = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.rope_inv_freq = tuple(inv_freq.tolist())
        self.rope_attn_factor = attn_factor

    # ------------------------------------------------------------------ shared with the chain draft
    def init_cache(self, batch: int, capacity: int) -> tuple[KVCache, ...]:
        cfg = self.cfg
        return tuple(KVCache.zeros(batch, capacity, cfg.num_key_value_heads, cfg.head_dim, self.dtype)
                     for _ in range(cfg.num_hidden_layers))

    def fuse(self, aux_BTX: jax.Array) -> jax.Array:
        return jnp.einsum("btx,xd->btd", aux_BTX.astype(self.dtype), self.fc[...])

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids + self.d2t[...][draft_ids]

    def head(self, out_BTD: jax.Array) -> jax.Array:
        return jnp.einsum("btd,dw->btw", self.norm(out_BTD), self.lm_head[...]).astype(jnp.float32)

    def _layers(self, ids_BT, hidden_BTD, positions_BT, cache, mask_BTT, with_logits) -> DraftStep:
        emb_BTD = jnp.take(self.embed_tokens[...], ids_BT, axis=0).astype(self.dtype)
        cos, sin = rope_cos_sin(positions_BT, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attn_factor)
        h_BTD, new_cache = hidden_BTD, []
        for i, layer in enumerate(self.layers):
            h_BTD, c = layer(emb_BTD, h_BTD, positions_BT, cos, sin, None if cache is None else cache[i], mask_BTT)
            new_cache.append(c)
        return DraftStep(hidden_BTD=h_BTD, logits_BTW=self.head(h_BTD) if with_logits else None,
                         cache=None if cache is None else tuple(new_cache))

    def __call__(self, ids_BT, hidden_BTD, positions_BT, embed_VD=None, cache=None, attend=None,
                 with_logits: bool = True) -> DraftStep:
        """Known positions (depth 0): ``hidden_BTD`` is fc(aux) at each position and ``ids_BT[:, t]``
        the token after it. With a cache (prefill, catch-up) the keys are kept for later rounds;
        without one the tokens attend causally among themselves."""
        if attend is not None:
            raise ValueError("PEagleDraft has no training-time-test hook; train it with forward_rollouts")
        return self._layers(ids_BT, hidden_BTD, positions_BT, cache, None, with_logits)

    # ------------------------------------------------------------------ parallel drafting
    def propose(self, positions_BK: jax.Array, cache: tuple[KVCache, ...]) -> DraftStep:
        """Logits of the guessed positions ``positions_BK`` (anchor + 1 .. anchor + K - 1; the cache
        holds the known ones) in one pass over MASK inputs. Their keys, written into the cache, lie
        past every row's length (masked by position) until a catch-up overwrites them."""
        B, K = positions_BK.shape
        mask_id = self.cfg.require_mask_token()
        hidden_D = jnp.einsum("x,xd->d", self.mask_hidden[...], self.fc[...])
        hidden_BKD = jnp.broadcast_to(hidden_D.astype(self.dtype), (B, K, hidden_D.shape[-1]))
        return self._layers(jnp.full((B, K), mask_id, jnp.int32), hidden_BKD, positions_BK, cache, None, True)

    def forward_rollouts(self, ids_BT, aux_BTX, depth_BT, positions_BT, mask_BTT) -> DraftStep:
        """Training and checking: tokens laid out as rollouts (``depth_BT`` 0 = known, with its
        ``ids_BT`` and ``aux_BTX``; > 0 = guessed, whose ids and aux are replaced by the MASK token
        and ``mask_hidden``), under an explicit ``mask_BTT`` (see :func:`rollout_mask`)."""
        known_BT = depth_BT == 0
        ids_BT = jnp.where(known_BT, ids_BT, self.cfg.require_mask_token())
        aux_BTX = jnp.where(known_BT[..., None], aux_BTX.astype(self.dtype), self.mask_hidden[...][None, None])
        return self._layers(ids_BT, self.fuse(aux_BTX), positions_BT, None, mask_BTT, True)
