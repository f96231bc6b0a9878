"""Stage 3: pre-train the demo target, a small DeepseekV3-architecture MoE, as a next-token LM.

The model is the product's own ``Target`` (MLA with a q LoRA, a dense first layer, then MoE layers
with a sigmoid router, a correction bias, group-limited top-2 routing and a shared expert), trained
with optax AdamW. Its routed experts run through a differentiable kernel of ``eagle3_jax.models.moe``:
``padded_blocks`` (exact, ~4x cheaper than ``ragged`` on CPU) by default, or ``ragged``.

Load balancing follows DeepSeek-V3's auxiliary-loss-free method: after every step each MoE
layer's ``e_score_correction_bias`` moves by ``bias_update_rate`` towards balance (up for experts
that got fewer than the mean number of tokens in the batch, down for those that got more). The
bias only steers which experts are chosen, never the mixing weights, so it gets no gradient and
is kept out of the optimizer.

The learning rate warms up, then follows a cosine to 10 % of the peak over the run's *budget*:
the fraction done is max(step / max_steps, elapsed / max_seconds). On a shared 2-core machine the
step time is not known in advance, so tying the schedule to wall time makes a time-capped run end
annealed instead of being cut off at a high learning rate.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np


# The target's shape. Sized for a 2-core CPU: ~10M parameters, most of them in the 8 routed experts
# and the 8k-vocabulary embedding and head.
TARGET_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,          # the dense first layer
    "moe_intermediate_size": 128,      # each routed expert; the shared expert has the same width
    "num_hidden_layers": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def target_hf_config(vocab_size: int, bos_id: int, eos_id: int, max_positions: int) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "max_position_embeddings": max_positions,
        **TARGET_SHAPE,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


@dataclass(frozen=True)
class TrainSettings:
    seq_len: int = 256
    batch_size: int = 16
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-2
    max_steps: int = 100_000
    max_seconds: float = 40 * 60
    eval_every_seconds: float = 150.0
    eval_windows: int = 48
    # "Flattened": the best held-out loss improved by less than this over the last `patience` evals.
    flat_delta: float = 0.01
    patience: int = 3
    seed: int = 0
    moe_kernel: str = "padded_blocks"


# ---------------------------------------------------------------------- params on disk
def flat_arrays(*states) -> dict:
    """nnx states -> {path tuple: numpy array}."""
    from flax import nnx

    out = {}
    for state in states:
        for path, var in nnx.to_flat_state(state):
            out[tuple(path)] = np.asarray(var.value if hasattr(var, "value") else var)
    return out


def save_params(path: str, flat: dict, meta: dict) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **{"/".join(str(p) for p in k): v for k, v in flat.items()})
    os.replace(tmp, path)


def load_params(path: str) -> tuple[dict, dict]:
    with np.load(path) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        flat = {tuple(int(p) if p.isdigit() else p for p in k.split("/")): z[k] for k in z.files if k != "__meta__"}
    return flat, meta


def build_target(hf_config: dict, seed: int, moe_kernel: str = "ragged"):
    import jax.numpy as jnp
    from flax import nnx

    from eagle3_jax.config import TargetConfig
    from eagle3_jax.models.target import Target

    cfg = TargetConfig.from_hf_dict(hf_config, where="demo target config")
    return cfg, Target(cfg, jnp.float32, nnx.Rngs(seed), moe_kernel=moe_kernel)


def count_params(flat: dict) -> int:
    return int(sum(v.size for v in flat.values()))


def active_params(cfg, flat: dict) -> int:
    """Parameters one token touches (embedding row excluded): all but the unchosen routed experts."""
    total = count_params(flat) - cfg.vocab_size * cfg.hidden_size
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return int(total - n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert)


# ---------------------------------------------------------------------- training
def lr_at(s: TrainSettings, step: int, elapsed: float) -> float:
    warm = min(1.0, (step + 1) / s.warmup_steps)
    frac = min(1.0, max(step / s.max_steps, elapsed / s.max_seconds))
    return s.peak_lr * warm * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens spread evenly over the held-out stream."""
    total = (len(stream) - 1) // seq_len
    if total < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    picks = np.linspace(0, total - 1, min(n, total)).astype(np.int64)
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in picks]).astype(np.int32)


def train(hf_config: dict, train_stream: np.ndarray, heldout_stream: np.ndarray, s: TrainSettings,
          log_path: str, ckpt_path: str, say=print) -> dict:
    """Trains from scratch; returns a summary. The parameters are written to ``ckpt_path`` (npz)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from eagle3_jax.models import moe

    t_start = time.perf_counter()
    cfg, model = build_target(hf_config, s.seed, s.moe_kernel)
    graphdef, bias, params = nnx.split(model, nnx.PathContains("e_score_correction_bias"), nnx.Param)
    bias_layers = [path[1] for path, _ in nnx.to_flat_state(bias)]
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    # The bias leaves flatten in layer order, the order the forward pass routes in.
    assert bias_layers == moe_layers, (bias_layers, moe_layers)
    flat0 = flat_arrays(bias, params)
    n_params = count_params(flat0)
    say(f"target: {n_params / 1e6:.2f}M parameters ({active_params(cfg, flat0) / 1e6:.2f}M active per token), "
        f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} routed experts top-{cfg.num_experts_per_tok}")

    tx = optax.chain(
        optax.clip_by_global_norm(s.grad_clip),
        optax.inject_hyperparams(optax.adamw)(
            learning_rate=s.peak_lr, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )
    opt_state = tx.init(params)
    E = cfg.n_routed_experts

    def loss_fn(params, bias, ids_BT1):
        m = nnx.merge(graphdef, bias, params)
        x_BT, y_BT = ids_BT1[:, :-1], ids_BT1[:, 1:]
        B, T = x_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        # The bias update needs the per-expert token counts of this same forward pass.
        out, picked = moe.capture_routes(lambda m: m(x_BT, positions_BT, m.init_cache(B, T)))(m)
        logits_BTV = m.logits(out.hidden_BTD)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()
        loads_LE = jnp.stack([jnp.bincount(idx.reshape(-1), length=E) for idx in picked])
        return loss, loads_LE

    @jax.jit
    def train_step(params, opt_state, bias, ids_BT1, lr):
        (loss, loads_LE), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, bias, ids_BT1)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # Aux-loss-free balancing: push each layer's bias towards equal expert loads.
        load_LE = loads_LE.astype(jnp.float32)
        step_LE = s.bias_update_rate * jnp.sign(load_LE.mean(-1, keepdims=True) - load_LE)
        leaves, treedef = jax.tree.flatten(bias)
        bias = jax.tree.unflatten(treedef, [b + step_LE[n] for n, b in enumerate(leaves)])
        imbalance = (load_LE.max(-1) / load_LE.mean(-1)).max()
        return params, opt_state, bias, loss, imbalance

    @jax.jit
    def eval_step(params, bias, ids_BT1):
        return loss_fn(params, bias, ids_BT1)[0]

    evals = eval_windows(heldout_stream, s.seq_len, s.eval_windows)

    def heldout_loss(params, bias):
        b = min(s.batch_size, len(evals))
        return float(np.mean([float(eval_step(params, bias, jnp.asarray(evals[i:i + b])))
                              for i in range(0, len(evals) - b + 1, b)]))

    rng = np.random.default_rng(s.seed)
    n_starts = len(train_stream) - s.seq_len - 1

    def batch():
        starts = rng.integers(0, n_starts, size=s.batch_size)
        return jnp.asarray(np.stack([train_stream[i:i + s.seq_len + 1] for i in starts]).astype(np.int32))

    say(f"train stream {len(train_stream):,} tokens, held-out eval {evals.size:,} tokens; "
        f"batch {s.batch_size} x {s.seq_len}; budget {s.max_seconds / 60:.1f} min or {s.max_steps} steps")
    log = open(log_path, "w")
    step, tokens = 0, 0
    best = (float("inf"), 0)
    history: list[float] = []
    window_losses: list[float] = []
    t0 = time.perf_counter()  # the schedule's clock; compile time is inside the budget too
    t_last_eval = t0
    stop_reason = "max_steps"

    last_train_loss = [float("nan")]

    def record(step, elapsed, lr, imbalance):
        nonlocal best
        hl = heldout_loss(params, bias)
        history.append(hl)
        tl = float(np.mean(window_losses)) if window_losses else float("nan")
        window_losses.clear()
        last_train_loss[0] = tl
        row = {"step": step, "tokens": tokens, "train_loss": round(tl, 4), "heldout_loss": round(hl, 4),
               "lr": lr, "elapsed_s": round(elapsed, 1), "expert_load_max_over_mean": round(imbalance, 3)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        say(f"  step {step:5d}  tokens {tokens / 1e6:6.2f}M  train {tl:.3f}  held-out {hl:.3f}  "
            f"lr {lr:.2e}  load max/mean {imbalance:.2f}  {elapsed / 60:.1f} min")
        if hl < best[0]:
            best = (hl, step)
            save_params(ckpt_path, flat_arrays(bias, params),
                        {"step": step, "heldout_loss": hl, "tokens": tokens, "config": hf_config})
        return hl

    lr, imbalance = s.peak_lr, float("nan")
    record(0, 0.0, 0.0, imbalance)
    while step < s.max_steps:
        elapsed = time.perf_counter() - t0
        if elapsed >= s.max_seconds:
            stop_reason = "max_minutes"
            break
        lr = lr_at(s, step, elapsed)
        params, opt_state, bias, loss, imb = train_step(params, opt_state, bias, batch(), jnp.float32(lr))
        step += 1
        tokens += s.batch_size * s.seq_len
        window_losses.append(float(loss))
        imbalance = float(imb)
        if step % 25 == 0:
            say(f"    step {step} loss {np.mean(window_losses[-25:]):.3f} lr {lr:.2e} "
                f"({(time.perf_counter() - t0) / step:.2f} s/step)")
        now = time.perf_counter()
        if now - t_last_eval >= s.eval_every_seconds:
            t_last_eval = now
            record(step, now - t0, lr, imbalance)
            if len(history) > s.patience and min(history[:-s.patience]) - min(history[-s.patience:]) < s.flat_delta:
                stop_reason = "held-out loss flattened"
                break
    if window_losses:
        record(step, time.perf_counter() - t0, lr, imbalance)
    log.close()
    return {
        "params": n_params, "active_params": active_params(cfg, flat0), "steps": step, "tokens": tokens,
        "best_heldout_loss": best[0], "best_step": best[1], "final_train_loss": last_train_loss[0],
        "final_heldout_loss": history[-1],
        "stop_reason": stop_reason, "wall_s": time.perf_counter() - t_start,
        "settings": s.__dict__,
    }
