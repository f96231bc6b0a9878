"""A draft that really accepts: trained briefly on the tiny target's own greedy outputs.

Only step 0 of EAGLE-3 training (the draft fed the target's aux states), hard labels, plain Adam:
enough to make drafts accepted often, which is what the lossless tests need to exercise
multi-token acceptance. The product's trainer (train/) is tested separately.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.drafts.eagle3.config import DraftConfig


def tiny_draft_config(target_cfg, aux_ids=(0, 1, 2), draft_vocab=None, **extra) -> DraftConfig:
    d = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": target_cfg.hidden_size, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": draft_vocab or target_cfg.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "num_hidden_layers": 1,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
    }
    d.update(extra)
    return DraftConfig.from_hf_dict(d)


def target_greedy_corpus(target, n_prompts=48, prompt_len=6, new_tokens=40, seed=0):
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, target.config.vocab_size, size=(n_prompts, prompt_len)).tolist()
    res = e3.Generator(target, None, max_len=prompt_len + new_tokens + 1).generate(prompts, new_tokens)
    return np.array([p + t for p, t in zip(prompts, res.tokens)])


def train_draft_on_target(target, draft: e3.LoadedDraft, seqs: np.ndarray, steps=300, lr=3e-3, batch=16, seed=0):
    """Hard-label step-0 training: draft(token t+1, aux t) -> target argmax at t+1."""
    aux_ids = draft.aux_layer_ids
    outs = [target.forward(seqs[i:i + batch], aux_layer_ids=aux_ids) for i in range(0, len(seqs), batch)]
    aux = np.concatenate([np.asarray(o.aux_hidden) for o in outs])
    labels = np.concatenate([np.asarray(o.logits).argmax(-1) for o in outs])
    ids_in, aux_in, y = seqs[:, 1:], aux[:, :-1], labels[:, 1:]
    embed = target.model.embed_tokens.value
    model = nnx.merge(draft.graphdef, draft.state)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    def loss_fn(params, ids, a, y):
        m = nnx.merge(graphdef, params, rest)
        B, T = ids.shape
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        logits = m(ids, m.fuse(a), pos, embed, None).logits_BTW
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, ids, a, y):
        loss, g = jax.value_and_grad(loss_fn)(params, ids, a, y)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.choice(len(seqs), size=batch, replace=False)
        params, opt_state, loss = step(params, opt_state, ids_in[idx], aux_in[idx], y[idx])
    trained = nnx.merge(graphdef, params, rest)
    return e3.LoadedDraft(trained, target, aux_ids), float(loss)
