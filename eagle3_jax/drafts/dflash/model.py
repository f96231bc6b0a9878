"""DFlash: a block drafter over the target's context features (SpecForge ``DFlashDraftModel``).

One pass guesses a whole block from the context (the target's states at ``aux_layer_ids`` for every
verified position) and the block (the target's embeddings of the last verified token and
``block_size - 1`` MASK tokens, at the positions that follow).

    ctx_SD  = hidden_norm(fc(aux_SX))                         once per position, shared by all layers
    layer   : xn = input_layernorm(x)
              q  = rope(q_norm(q_proj(xn)))                   at the block's positions
              k  = rope(k_norm(k_proj([ctx, xn]))),  v = v_proj([ctx, xn])
              x  = x + o_proj(attend(q, k, v));  x = x + mlp(post_attention_layernorm(x))
    out     = norm(x);   logits = the target's lm_head(out)   block offset j >= 1 guesses the token there

A block anchored at position a sees the context before a and its own block (:func:`block_mask`; a
sliding layer only context in [a + j - W + 1, a) and its block up to offset j). Context keys depend
only on the target's states, so serving caches them per layer (:meth:`write_context`) and one pass
over that cache and a fresh block proposes a round's tokens (:meth:`propose`); the block is always
``block_size`` wide, as trained. With ``attention_mode: mla`` the layers attend with
:class:`~eagle3_jax.drafts.dflash.mla.DFlashMLAttention` (same interface, latent-wide cache).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.drafts.dflash.config import SLIDING, DFlashConfig
from eagle3_jax.drafts.dflash.mla import DFlashMLAttention, linear
from eagle3_jax.models import attention_core as core
from eagle3_jax.models.cache import KVCache
from eagle3_jax.models.layers import RMSNorm, SwiGLU, apply_rope, param, rope_cos_sin, rope_inv_freq


def block_mask(anchor_BN: jax.Array, keep_BN: jax.Array, S: int, block: int, window: int | None = None
               ) -> jax.Array:
    """[B, N * block, S + N * block]: for N blocks (block n anchored at ``anchor_BN[:, n]``, kept where
    ``keep_BN``) which keys each block token sees among S context positions then the blocks' tokens;
    ``window``: the sliding-attention rule."""
    B, N = anchor_BN.shape
    q_T = jnp.arange(N * block)
    kv_K = jnp.arange(S + N * block)
    q_block_T, q_off_T = q_T // block, q_T % block
    anchor_BT = jnp.repeat(anchor_BN, block, axis=1)
    ctx_BTK = (kv_K[None, None, :] < S) & (kv_K[None, None, :] < anchor_BT[:, :, None])
    own_TK = (kv_K[None, :] >= S) & ((kv_K[None, :] - S) // block == q_block_T[:, None])
    if window is not None:
        ctx_BTK &= kv_K[None, None, :] >= (anchor_BT + q_off_T[None, :] - (window - 1))[:, :, None]
        own_TK &= (kv_K[None, :] - S) % block <= q_off_T[:, None]
    return (ctx_BTK | own_TK[None]) & jnp.repeat(keep_BN, block, axis=1)[:, :, None]


class DFlashAttention(nnx.Module):
    """GQA with per-head q/k RMSNorm (Qwen3) and rotate-half RoPE; keys and values come from the
    context states and the block alike."""

    def __init__(self, cfg: DFlashConfig, dtype, rngs):
        D, N, G, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), dtype)
        self.k_proj = param(rngs, (D, G, H), ("embed", "heads", "head_dim"), dtype)
        self.v_proj = param(rngs, (D, G, H), ("embed", "heads", "head_dim"), dtype)
        self.o_proj = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), dtype)
        bias = cfg.attention_bias
        self.q_bias = param(None, (N, H), ("heads", "head_dim"), dtype) if bias else None
        self.k_bias = param(None, (G, H), ("heads", "head_dim"), dtype) if bias else None
        self.v_bias = param(None, (G, H), ("heads", "head_dim"), dtype) if bias else None
        self.o_bias = param(None, (D,), ("embed",), dtype) if bias else None
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, axes=("head_dim",))
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, dtype, axes=("head_dim",))
        self.softmax_scale = float(H) ** -0.5

    def keys(self, x_BTD, cos_BTH, sin_BTH):
        """Normed, rotated keys and values of ``x_BTD`` (context states or the block's normed input)."""
        k_BTGH = self.k_norm(linear("btd,dgh->btgh", x_BTD, self.k_proj, self.k_bias))
        k_BTGH = apply_rope(k_BTGH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        return k_BTGH, linear("btd,dgh->btgh", x_BTD, self.v_proj, self.v_bias)

    def __call__(self, xn_BTD, cos_BTH, sin_BTH, attend):
        """``attend(q_BTNH, k_BTGH, v_BTGH) -> out_BTNH``: the block's queries, keys and values in, and
        the caller says which context keys and which block keys each query sees."""
        q_BTNH = self.q_norm(linear("btd,dgh->btgh", xn_BTD, self.q_proj, self.q_bias))
        q_BTNH = apply_rope(q_BTNH, cos_BTH[:, :, None], sin_BTH[:, :, None], interleaved=False)
        k_BTGH, v_BTGH = self.keys(xn_BTD, cos_BTH, sin_BTH)
        out_BTNH = attend(q_BTNH, k_BTGH, v_BTGH)
        y_BTD = jnp.einsum("btnh,nhd->btd", out_BTNH.astype(v_BTGH.dtype), self.o_proj[...])
        return y_BTD if self.o_bias is None else y_BTD + self.o_bias[...]


def attend_masked(ctx_k_BSGH, ctx_v_BSGH, mask_BTK, scale: float):
    """An ``attend`` over the context's keys then the block's, under ``mask_BTK`` [B, T, S + T] (the
    core's dense form), scores scaled by ``scale``. A query that sees no key (a dropped block) gives
    zeros: it attends everywhere, then is zeroed, so neither values nor gradients turn NaN."""
    seen_BT = jnp.any(mask_BTK, axis=-1)

    def attend(q_BTNH, k_BTGH, v_BTGH):
        k_BKGH = jnp.concatenate([ctx_k_BSGH, k_BTGH.astype(ctx_k_BSGH.dtype)], axis=1)
        v_BKGH = jnp.concatenate([ctx_v_BSGH, v_BTGH.astype(ctx_v_BSGH.dtype)], axis=1)
        out_BTNH, _ = core.dense(*core.grouped(q_BTNH, k_BKGH, v_BKGH, scale), mask_BTK | ~seen_BT[:, :, None])
        return jnp.where(seen_BT[:, :, None, None], out_BTNH, 0.0)
    return attend


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: DFlashConfig, sliding: bool, dtype, rngs):
        D = cfg.hidden_size
        self.sliding = sliding
        self.input_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.self_attn = (DFlashAttention if cfg.mla is None else DFlashMLAttention)(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(D, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x_BTD, cos_BTH, sin_BTH, attend):
        h_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), cos_BTH, sin_BTH, attend)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class DFlashDraft(nnx.Module):
    """The draft's weights and its one pass; the token embedding and the head are the target's."""

    def __init__(self, cfg: DFlashConfig, n_aux: int, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        D = cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.fc = param(rngs, (n_aux * D, D), ("aux", "embed"), dtype)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.layers = nnx.List([DFlashLayer(cfg, t == SLIDING, dtype, rngs) for t in cfg.layer_types])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        inv_freq, attn_factor = rope_inv_freq(cfg.rope, cfg.rope_dim, cfg.max_position_embeddings)
        self.rope_inv_freq = tuple(inv_freq.tolist())
        self.rope_attn_factor = attn_factor

    def _rope(self, positions_BT):
        return rope_cos_sin(positions_BT, jnp.asarray(self.rope_inv_freq, jnp.float32), self.rope_attn_factor)

    def context(self, aux_BSX: jax.Array) -> jax.Array:
        """The target's concatenated states -> the context states every layer reads."""
        return self.hidden_norm(jnp.einsum("bsx,xd->bsd", aux_BSX.astype(self.dtype), self.fc[...]))

    def context_keys(self, aux_BSX: jax.Array, positions_BS: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer, the context's (keys, values) [B, S, G, H] at ``positions_BS`` (MLA: G = 1, the
        latent and rope key, and the latent)."""
        ctx_BSD = self.context(aux_BSX)
        cos, sin = self._rope(positions_BS)
        return [layer.self_attn.keys(ctx_BSD, cos, sin) for layer in self.layers]

    def __call__(self, noise_BTD, positions_BT, attends) -> jax.Array:
        """The block's outputs ``norm(x)`` [B, T, D]. ``noise_BTD``: the block's token embeddings at
        ``positions_BT``; ``attends``: one ``attend`` per layer (see :class:`DFlashAttention`)."""
        cos, sin = self._rope(positions_BT)
        x_BTD = noise_BTD.astype(self.dtype)
        for layer, attend in zip(self.layers, attends):
            x_BTD = layer(x_BTD, cos, sin, attend)
        return self.norm(x_BTD)

    def forward_blocks(self, aux_BSX, embed_VD, ids_BS, anchor_BN, keep_BN) -> jax.Array:
        """Training and checking: N blocks over one sequence of S tokens (``ids_BS`` with the target's
        states ``aux_BSX``), block n anchored at ``anchor_BN[:, n]`` (its known token; the rest are
        MASK tokens at the positions that follow). Returns the blocks' outputs [B, N * block, D]."""
        B, S = ids_BS.shape
        bs, mask_id = self.cfg.block_size, self.cfg.require_mask_token()
        offsets = jnp.arange(bs)
        ids_BT = jnp.where(offsets[None, None, :] == 0,
                           jnp.take_along_axis(ids_BS, jnp.where(keep_BN, anchor_BN, 0), axis=1)[:, :, None],
                           mask_id)
        ids_BT = jnp.where(keep_BN[:, :, None], ids_BT, mask_id).reshape(B, -1)
        positions_BT = (anchor_BN[:, :, None] + offsets).reshape(B, -1)
        positions_BS = jnp.broadcast_to(jnp.arange(S), (B, S))
        full = block_mask(anchor_BN, keep_BN, S, bs)
        sliding = None if self.cfg.sliding_window is None else block_mask(anchor_BN, keep_BN, S, bs,
                                                                          self.cfg.sliding_window)
        attends = [attend_masked(k_BSGH, v_BSGH, sliding if layer.sliding else full, layer.self_attn.softmax_scale)
                   for layer, (k_BSGH, v_BSGH) in zip(self.layers, self.context_keys(aux_BSX, positions_BS))]
        return self(jnp.take(embed_VD, ids_BT, axis=0), positions_BT, attends)

    # ------------------------------------------------------------------ serving (the decode loop)
    def init_cache(self, batch: int, capacity: int) -> tuple[KVCache, ...]:
        cfg, m = self.cfg, self.cfg.mla
        G, H, Y = ((cfg.num_key_value_heads, cfg.head_dim, None) if m is None
                   else (1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank))
        return tuple(KVCache.zeros(batch, capacity, G, H, self.dtype, value_dim=Y)
                     for _ in range(cfg.num_hidden_layers))

    def to_target_ids(self, ids: jax.Array) -> jax.Array:
        return ids   # the block's guesses come from the target's own head: target ids already

    def write_context(self, aux_BTX, positions_BT, cache: tuple[KVCache, ...]) -> tuple[KVCache, ...]:
        """Each layer's context keys of the target's states ``aux_BTX`` written at ``positions_BT``.
        Positions later found unverified are masked by the next anchor, then overwritten."""
        kv = self.context_keys(aux_BTX, positions_BT)
        return tuple(c.write(k_BTGH, v_BTGH, positions_BT) for c, (k_BTGH, v_BTGH) in zip(cache, kv))

    def propose(self, last_B, anchor_B, cache: tuple[KVCache, ...], embed_VD) -> jax.Array:
        """The block's outputs [B, block, D] for the block anchored at ``anchor_B`` (the position of
        ``last_B``, the newest token): offset j >= 1 guesses the token at anchor + j. The cache holds
        the context before the anchor. A full layer reads the filled slots blockwise and its block
        densely, one softmax over both (``core.merge``); a sliding layer gathers the W - 1 slots
        before the anchor."""
        cfg = self.cfg
        B, bs = last_B.shape[0], cfg.block_size
        ids_BT = jnp.concatenate([last_B[:, None], jnp.full((B, bs - 1), cfg.require_mask_token(), last_B.dtype)], 1)
        off_T = jnp.arange(bs)
        positions_BT = anchor_B[:, None] + off_T[None, :]
        return self(jnp.take(embed_VD, ids_BT, axis=0), positions_BT,
                    [self._serving_attend(c, layer.sliding, anchor_B, layer.self_attn.softmax_scale)
                     for layer, c in zip(self.layers, cache)])

    def _serving_attend(self, cache: KVCache, sliding: bool, anchor_B, scale: float):
        bs, S = self.cfg.block_size, cache.capacity
        B = anchor_B.shape[0]
        off_T = jnp.arange(bs)
        if sliding:   # slots anchor - W + 1 .. anchor - 1, each seen from the offsets the window reaches
            W = self.cfg.sliding_window
            slots_BW = anchor_B[:, None] - (W - 1) + jnp.arange(W - 1)[None, :]
            rows_BW = jnp.arange(B)[:, None]
            k_BWGH, v_BWGH = (x[rows_BW, jnp.clip(slots_BW, 0, S - 1)] for x in (cache.k_BSGH, cache.v_BSGH))
            low_BT = anchor_B[:, None] + off_T[None, :] - (W - 1)
            ctx_BTW = (slots_BW[:, None, :] >= 0) & (slots_BW[:, None, :] >= low_BT[:, :, None])
            own_BTT = jnp.broadcast_to(off_T[None, :] <= off_T[:, None], (B, bs, bs))
            return attend_masked(k_BWGH, v_BWGH, jnp.concatenate([ctx_BTW, own_BTT], axis=-1), scale)

        def attend(q_BTNH, k_BTGH, v_BTGH):
            seen_BT = jnp.broadcast_to(anchor_B[:, None] - 1, (B, bs))   # context slots 0..anchor-1
            ctx = core.blockwise(*core.grouped(q_BTNH, cache.k_BSGH, cache.v_BSGH, scale), seen_BT, S,
                                 core.key_block(S, bs, q_BTNH.shape[2]))
            own = core.dense(*core.grouped(q_BTNH, k_BTGH, v_BTGH, scale), None, keys=bs)
            return core.merge(*ctx, *own)
        return attend
