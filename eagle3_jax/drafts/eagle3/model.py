"""The EAGLE-3 draft (SGLang / SpecForge ``LlamaForCausalLMEagle3`` compatible).

    fused   = fc(aux)                       aux: the target's low/mid/high states, concatenated
    x       = concat[input_layernorm(embed(token)), hidden_norm(hidden)]      (embedding first, 2D)
    h       = hidden (or hidden_norm(hidden) with norm_before_residual) + attn(x)
    out     = h + mlp(post_attention_layernorm(h))
    logits  = lm_head(norm(out))            over the draft vocab; target id = id + d2t[id]

``out`` is fed back as the next step's ``hidden``. The same module serves generation and training.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.eagle3.config import DraftConfig
from eagle3_jax.models.attention import attend_filled_gqa, masked_softmax
from eagle3_jax.models.cache import KVCache
from eagle3_jax.models.layers import RMSNorm, SwiGLU, apply_rope, param, rope_cos_sin, rope_inv_freq


class Buffer(nnx.Variable):
    """Non-trainable state saved with the draft (the vocab maps)."""


class DraftAttention(nnx.Module):
    """Llama GQA over 2D-wide input, rotate-half RoPE, with a fixed-size KV cache."""

    def __init__(self, cfg: DraftConfig, dtype, rngs):
        D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = param(rngs, (2 * D, N, H), ("embed", "heads", "head_dim"), dtype)
        self.k_proj = param(rngs, (2 * D, G, H), ("embed", "heads", "head_dim"), dtype)
        self.v_proj = param(rngs, (2 * D, G, H), ("embed", "heads", "head_dim"), dtype)
        self.o_proj = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype)

    def __call__(self, x_BT2D, positions_BT, cos_BTH, sin_BTH, cache: KVCache | None, attend=None):
        cfg = self.cfg
        G = cfg.num_key_value_heads
        R = cfg.num_attention_heads // G
        q_BTNH = jnp.einsum("btx,xnh->btnh", x_BT2D, self.q_proj[...])
        k_BTGH = jnp.einsum("btx,xgh->btgh", x_BT2D, self.k_proj[...])
        v_BTGH = jnp.einsum("btx,xgh->btgh", x_BT2D, self.v_proj[...])
        q_BTNH = apply_rope(q_BTNH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        k_BTGH = apply_rope(k_BTGH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        if attend is not None:
            # Training-time test: the caller owns which keys each query sees (earlier simulated
            # steps); it returns the per-head output and whatever state it wants back.
            if cache is not None:
                raise ValueError("DraftAttention: pass either a KV cache or an attend function, not both")
            out_BTNH, state = attend(q_BTNH, k_BTGH, v_BTGH)
            return jnp.einsum("btnh,nhd->btd", out_BTNH, self.o_proj[...]), state
        if cache is None:  # one causal pass over the given tokens (training, TTT step 0)
            k_BSGH, v_BSGH = k_BTGH, v_BTGH   # keys are this call's tokens: S = T
            mask_BTS = positions_BT[:, None, :] <= positions_BT[:, :, None]
        else:  # over the filled slots only: cost follows the longest row, not the capacity
            cache = cache.write(k_BTGH, v_BTGH, positions_BT)
            out_BTNH = attend_filled_gqa(q_BTNH, cache, positions_BT, cfg.head_dim ** -0.5)
            return jnp.einsum("btnh,nhd->btd", out_BTNH, self.o_proj[...]), cache
        B, T = q_BTNH.shape[:2]
        q_BTGRH = q_BTNH.reshape(B, T, G, R, cfg.head_dim)
        scores_BTGRS = jnp.einsum("btgrh,bsgh->btgrs", q_BTGRH, k_BSGH) * cfg.head_dim ** -0.5
        S = k_BSGH.shape[1]
        probs = masked_softmax(scores_BTGRS.reshape(B, T, G * R, S), mask_BTS).reshape(B, T, G, R, S)
        out_BTGRH = jnp.einsum("btgrs,bsgh->btgrh", probs.astype(v_BSGH.dtype), v_BSGH)
        y_BTD = jnp.einsum("btnh,nhd->btd", out_BTGRH.reshape(B, T, G * R, cfg.head_dim), self.o_proj[...])
        return y_BTD, cache


@dataclass
class DraftStep:
    hidden_BTD: jax.Array   # pre-norm output: fed back as the next step's hidden
    logits_BTW: jax.Array   # float32, over the draft vocab
    cache: KVCache | None   # with ``attend``: the state attend returned instead


class Draft(nnx.Module):
    def __init__(self, cfg: DraftConfig, n_aux: int, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
                 own_embedding: bool = False):
        D, W, V = cfg.hidden_size, cfg.draft_vocab_size, cfg.vocab_size
        self.cfg = cfg
        self.dtype = dtype
        self.fc = param(rngs, (n_aux * cfg.target_hidden_size, D), ("aux", "embed"), dtype)
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
        return jnp.einsum("btx,xd->btd", aux_BTX.astype(self.dtype), self.fc[...])

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        return draft_ids + self.d2t[...][draft_ids]

    def head(self, out_BTD: jax.Array) -> jax.Array:
        """Draft-vocab logits (float32) of decoder outputs."""
        return jnp.einsum("btd,dw->btw", self.norm(out_BTD), self.lm_head[...]).astype(jnp.float32)

    def __call__(self, ids_BT, hidden_BTD, positions_BT, embed_VD=None, cache: KVCache | None = None,
                 attend=None, with_logits: bool = True) -> DraftStep:
        """One decoder pass. ``hidden_BTD`` is fc(aux) or the draft's own previous output;
        ``ids_BT[:, t]`` is the token that follows the position ``hidden_BTD[:, t]`` came from.

        ``attend(q_BTNH, k_BTGH, v_BTGH) -> (out_BTNH, state)`` replaces the attention core (rotated
        queries/keys in, per-head output out) for training-time test; ``state`` comes back in
        ``DraftStep.cache``. Without it (serving) the computation is exactly as before.
        ``with_logits=False`` leaves ``logits_BTW`` None: a caller that needs logits at one position
        of many (prefill, catch-up) applies ``head`` to that position alone: the draft-vocab head is a
        fifth to a third of the draft's work per position (Kimi-K2.5's draft, the demo's)."""
        table = self.embed_tokens[...] if self.embed_tokens is not None else embed_VD
        emb_BTD = jnp.take(table, ids_BT, axis=0).astype(self.dtype)
        cos, sin = rope_cos_sin(positions_BT, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attn_factor)
        normed_hidden = self.hidden_norm(hidden_BTD)
        residual_BTD = normed_hidden if self.cfg.norm_before_residual else hidden_BTD
        x_BT2D = jnp.concatenate([self.input_layernorm(emb_BTD), normed_hidden], axis=-1)
        attn_BTD, cache = self.self_attn(x_BT2D, positions_BT, cos, sin, cache, attend)
        h_BTD = residual_BTD + attn_BTD
        out_BTD = h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))
        return DraftStep(hidden_BTD=out_BTD, logits_BTW=self.head(out_BTD) if with_logits else None, cache=cache)
