"""The EAGLE-3 draft (SGLang / SpecForge ``LlamaForCausalLMEagle3`` compatible).

    fused   = fc(aux)                       aux: the target's low/mid/high states, concatenated
    x       = concat[input_layernorm(embed(token)), hidden_norm(hidden)]      (embedding first, 2D)
    h       = hidden (or hidden_norm(hidden) with norm_before_residual) + attn(x)
    out     = h + mlp(post_attention_layernorm(h))
    logits  = lm_head(norm(out))            over the draft vocab; target id = id + d2t[id]

``out`` is fed back as the next step's ``hidden``. The same module serves generation and training.
EAGLE-3.1 flags: ``norm_before_fc`` applies ``input_norm`` to the whole aux before fc, ``fc_norm`` one
norm per aux state; with ``norm_output`` the step's output is ``norm(out)``, fed back and read by lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.models import attention_core as core
from eagle3_jax.models.cache import KVCache
from eagle3_jax.models.layers import RMSNorm, SwiGLU, apply_rope, param, rms_norm, rope_cos_sin, rope_inv_freq


class Buffer(nnx.Variable):
    """Non-trainable state saved with the draft (the vocab maps)."""


class DraftAttention(nnx.Module):
    """Llama GQA with rotate-half RoPE over ``width`` input features (2D in the EAGLE-3 layer), with
    a fixed-size KV cache."""

    def __init__(self, cfg: DraftConfig, dtype, rngs, width: int | None = None):
        D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * D if width is None else width
        self.q_proj = param(rngs, (width, N, H), ("embed", "heads", "head_dim"), dtype)
        self.k_proj = param(rngs, (width, G, H), ("embed", "heads", "head_dim"), dtype)
        self.v_proj = param(rngs, (width, G, H), ("embed", "heads", "head_dim"), dtype)
        self.o_proj = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype)

    def __call__(self, x_BTI, positions_BT, cos_BTH, sin_BTH, cache: KVCache | None, attend=None,
                 visible_BTS=None):
        """With a cache: write this call's keys at their positions and attend over the filled slots.
        Without: attend among this call's tokens, under ``visible_BTS`` or causally by position.
        ``attend(q_BTNH, k_BTGH, v_BTGH) -> (out_BTNH, state)`` (training-time test) decides which keys
        each query sees and returns the state to hand back in place of the cache."""
        q_BTNH = jnp.einsum("bti,inh->btnh", x_BTI, self.q_proj[...])
        k_BTGH = jnp.einsum("bti,igh->btgh", x_BTI, self.k_proj[...])
        v_BTGH = jnp.einsum("bti,igh->btgh", x_BTI, self.v_proj[...])
        q_BTNH = apply_rope(q_BTNH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        k_BTGH = apply_rope(k_BTGH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        if attend is not None:
            if cache is not None:
                raise ValueError("DraftAttention: pass either a KV cache or an attend function, not both")
            out_BTNH, cache = attend(q_BTNH, k_BTGH, v_BTGH)
        elif cache is not None:
            cache = cache.write(k_BTGH, v_BTGH, positions_BT)
            S, (T, N) = cache.capacity, q_BTNH.shape[1:3]
            out_BTNH, _ = core.blockwise(*core.grouped(q_BTNH, cache.k_BSGH, cache.v_BSGH), positions_BT, S,
                                         core.key_block(S, T, N))
        else:
            if visible_BTS is None:
                visible_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
            out_BTNH, _ = core.dense(*core.grouped(q_BTNH, k_BTGH, v_BTGH), visible_BTS)
        return jnp.einsum("btnh,nhd->btd", out_BTNH.astype(v_BTGH.dtype), self.o_proj[...]), cache


@dataclass
class DraftStep:
    hidden_BTD: jax.Array   # the output fed back as the next step's hidden (pre-norm unless norm_output)
    logits_BTW: jax.Array   # float32, over the draft vocab
    cache: KVCache | None   # with ``attend``: the state attend returned instead


class Draft(nnx.Module):
    def __init__(self, cfg: DraftConfig, n_aux: int, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 own_embedding: bool = False):
        D, W, V = cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size
        self.cfg = cfg
        self.dtype = dtype
        X = n_aux * cfg.target_hidden_size
        self.input_norm = RMSNorm(X, cfg.rms_norm_eps, dtype, axes=("aux",)) if cfg.norm_before_fc else None
        # one norm per aux state, stacked: [n_aux, target hidden]
        self.fc_norm = (param(None, (n_aux, cfg.target_hidden_size), (None, "embed"), dtype, init="ones")
                        if cfg.fc_norm else None)
        self.fc = param(rngs, (X, D), ("aux", "embed"), dtype)
        self.embed_tokens = param(rngs, (V, D), ("vocab", "embed"), dtype) if own_embedding else None
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.self_attn = DraftAttention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(D, cfg.intermediate_size, dtype, rngs)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.lm_head = param(rngs, (D, W), ("embed", "draft_vocab"), dtype)
        self.d2t = Buffer(jnp.zeros((W,), jnp.int32), axes=(None,))
        self.t2d = Buffer(jnp.ones((V,), jnp.bool_) if W == V else jnp.zeros((V,), jnp.bool_), axes=(None,))
        inv_freq, attn_factor = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
        self.rope_inv_freq = tuple(inv_freq.tolist())
        self.rope_attn_factor = attn_factor

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache.zeros(batch, capacity, cfg.num_key_value_heads, cfg.head_dim, self.dtype)

    def fuse(self, aux_BTX: jax.Array) -> jax.Array:
        """The target's concatenated aux states -> draft width."""
        aux_BTX = aux_BTX.astype(self.dtype)
        if self.input_norm is not None:
            aux_BTX = self.input_norm(aux_BTX)
        if self.fc_norm is not None:
            weights = self.fc_norm[...]   # [n_aux, target hidden]: the glossary has no letter for either
            per_state = aux_BTX.reshape(aux_BTX.shape[:2] + weights.shape)
            aux_BTX = rms_norm(per_state, weights, self.cfg.rms_norm_eps).reshape(aux_BTX.shape)
        return jnp.einsum("btx,xd->btd", aux_BTX, self.fc[...])

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids + self.d2t[...][draft_ids]

    def head(self, out_BTD: jax.Array) -> jax.Array:
        """Draft-vocab logits (float32) of decoder outputs (``DraftStep.hidden_BTD``)."""
        normed_BTD = out_BTD if self.cfg.norm_output else self.norm(out_BTD)   # norm_output: normed already
        return jnp.einsum("btd,dw->btw", normed_BTD, self.lm_head[...]).astype(jnp.float32)

    def __call__(self, ids_BT, hidden_BTD, positions_BT, embed_VD=None, cache: KVCache | None = None,
                 attend=None, with_logits: bool = True) -> DraftStep:
        """One decoder pass. ``hidden_BTD`` is fc(aux) or the draft's own previous output;
        ``ids_BT[:, t]`` is the token that follows the position ``hidden_BTD[:, t]`` came from.
        ``attend``: see ``DraftAttention``. ``with_logits=False`` leaves ``logits_BTW`` None, for a
        caller that applies ``head`` to one position of many (the head is much of a position's work)."""
        table = self.embed_tokens[...] if self.embed_tokens is not None else embed_VD
        emb_BTD = jnp.take(table, ids_BT, axis=0).astype(self.dtype)
        cos, sin = rope_cos_sin(positions_BT, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attn_factor)
        normed_hidden = self.hidden_norm(hidden_BTD)
        residual_BTD = normed_hidden if self.cfg.norm_before_residual else hidden_BTD
        x_BT2D = jnp.concatenate([self.input_layernorm(emb_BTD), normed_hidden], axis=-1)
        attn_BTD, cache = self.self_attn(x_BT2D, positions_BT, cos, sin, cache, attend)
        h_BTD = residual_BTD + attn_BTD
        out_BTD = h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))
        if self.cfg.norm_output:
            out_BTD = self.norm(out_BTD)
        return DraftStep(hidden_BTD=out_BTD, logits_BTW=self.head(out_BTD) if with_logits else None, cache=cache)
