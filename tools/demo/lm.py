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

The learning rate warms up, then follows a cosine to 10 % of the peak over a *step* budget
(``max_steps``), so a run that is stopped and resumed under a varying machine load follows exactly
the same schedule as an uninterrupted one. An optional wall-time budget (``max_seconds`` > 0) makes
the fraction done max(step / max_steps, elapsed / max_seconds) instead, which ends a time-capped
run annealed; it makes the schedule depend on the machine's speed, so the demo recipe leaves it off.

Training is resumable: every ``eval_every_steps`` steps (after the held-out evaluation) and every
``checkpoint_every_seconds`` of training, the full state (parameters, optimizer state, router bias,
step, the data sampler's random state, best loss so far, compute seconds spent) is written to
``state_path`` atomically (``lm_state.py``). ``train`` continues from that file when
it exists, and refuses when it was written with different settings, model or data. A resumed run
gives the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from dataclasses import dataclass

import numpy as np

from tools.demo.lm_state import (check_resumable, flat_arrays, load_state, save_params, save_state, stream_digest,
                                 training_lock)


# The target's shape (the rest of its config.json is tools/random_target.py's tiny target): deep and
# narrow like the real models relative to a one-layer draft, so that a draft step costs well under
# 0.15 of a target decode step on a CPU (24 layers; 16 layers measured 0.16). Fine-grained routed
# experts with top-k in groups as in DeepSeek-V3 (there 256 experts top-8, 8 groups keep 4; here 16
# top-4, 4 groups keep 2). ~22M parameters, ~44 MB in bf16, so that with the draft the demo stays
# under 60 MB; most of them are in the routed experts and the 8k-vocabulary embedding and head.
TARGET_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,          # the dense first layer
    "moe_intermediate_size": 48,       # each routed expert; the shared expert has the same width
    "num_hidden_layers": 24,
    "first_k_dense_replace": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_scaling": None,
    "rope_interleave": True,
}


def target_hf_config(vocab_size: int, bos_id: int, eos_id: int, max_positions: int) -> dict:
    from tools.random_target import hf_config_dict

    return hf_config_dict(**TARGET_SHAPE, vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id,
                          max_position_embeddings=max_positions, torch_dtype="bfloat16")


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
    # The demo recipe's budget: ~2 h of an idle 2-core CPU at the 24-layer shape (~4.8 s a step,
    # estimated from ~7 CPU-seconds a step measured on a busy machine), 3.1M tokens.
    max_steps: int = 1500
    max_seconds: float = 0.0           # > 0: a wall-time budget too (see the module docstring)
    eval_every_steps: int = 50
    eval_windows: int = 48
    # "Flattened": the best held-out loss improved by less than this over the last `patience` evals.
    flat_delta: float = 0.01
    patience: int = 3
    seed: int = 0
    moe_kernel: str = "padded_blocks"
    # How often the resumable state is written; the only setting a resumed run may change.
    checkpoint_every_seconds: float = 300.0


RESUMABLE_CHANGES = ("checkpoint_every_seconds",)


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
    frac = step / s.max_steps
    if s.max_seconds > 0:
        frac = max(frac, elapsed / s.max_seconds)
    frac = min(1.0, frac)
    return s.peak_lr * warm * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def eval_windows(stream: np.ndarray, seq_len: int, n: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens spread evenly over the held-out stream."""
    total = (len(stream) - 1) // seq_len
    if total < 1:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    picks = np.linspace(0, total - 1, min(n, total)).astype(np.int64)
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in picks]).astype(np.int32)


# (config, optimizer settings) -> (tx, train_step, eval_step): built and compiled once per process,
# so a run resumed in the same process (as in the tests) does not compile again.
_STEP_FUNCTIONS: dict = {}


def step_functions(hf_config: dict, s: TrainSettings, graphdef):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from tools.demo.routes import capture_routes

    key = json.dumps([hf_config, s.grad_clip, s.peak_lr, s.b1, s.b2, s.weight_decay, s.bias_update_rate,
                      s.moe_kernel], sort_keys=True)
    if key in _STEP_FUNCTIONS:
        return _STEP_FUNCTIONS[key]
    E = hf_config["n_routed_experts"]

    tx = optax.chain(
        optax.clip_by_global_norm(s.grad_clip),
        optax.inject_hyperparams(optax.adamw)(
            learning_rate=s.peak_lr, b1=s.b1, b2=s.b2, weight_decay=s.weight_decay,
            mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )

    def loss_fn(params, bias, ids_BT1):
        m = nnx.merge(graphdef, bias, params)
        x_BT, y_BT = ids_BT1[:, :-1], ids_BT1[:, 1:]
        B, T = x_BT.shape
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        # The bias update needs the per-expert token counts of this same forward pass.
        out, picked = capture_routes(lambda m: m(x_BT, positions_BT, m.init_cache(B, T)))(m)
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

    _STEP_FUNCTIONS[key] = tx, train_step, eval_step
    return _STEP_FUNCTIONS[key]


def train(hf_config: dict, train_stream: np.ndarray, heldout_stream: np.ndarray, s: TrainSettings,
          log_path: str, ckpt_path: str, state_path: str, say=print) -> dict:
    """Trains (resuming from ``state_path`` when it exists); returns a summary. The parameters with
    the best held-out loss are written to ``ckpt_path`` (npz), the resumable state to ``state_path``."""
    with training_lock(state_path):
        return _train(hf_config, train_stream, heldout_stream, s, log_path, ckpt_path, state_path, say)


def _train(hf_config, train_stream, heldout_stream, s, log_path, ckpt_path, state_path, say) -> dict:
    import jax.numpy as jnp
    from flax import nnx

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

    tx, train_step, eval_step = step_functions(hf_config, s, graphdef)
    opt_state = tx.init(params)

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

    # Everything that determines the run; a resumed run must match it.
    identity = {"settings": dict(s.__dict__), "config": hf_config,
                "data": {"train": stream_digest(train_stream), "heldout": stream_digest(heldout_stream)}}
    # The loop's state besides the arrays: what a resumed run needs to continue identically.
    st = {"step": 0, "tokens": 0, "best": [float("inf"), 0], "history": [], "window_losses": [],
          "elapsed_s": 0.0, "cpu_s": 0.0, "sessions": 0, "stop_reason": None, "lr": 0.0, "imbalance": float("nan")}
    if os.path.isfile(state_path):
        trees, meta = load_state(state_path, {"params": params, "bias": bias, "opt_state": opt_state})
        check_resumable(state_path, meta, identity, RESUMABLE_CHANGES)
        params, bias, opt_state = trees["params"], trees["bias"], trees["opt_state"]
        st.update(meta["loop"])
        rng.bit_generator.state = meta["rng"]
        # Drop log rows written after the state was saved: the resumed run writes them again.
        rows = [line for line in open(log_path) if json.loads(line)["step"] <= st["step"]] \
            if os.path.isfile(log_path) else []
        with open(log_path, "w") as f:
            f.writelines(rows)
        say(f"resuming from {state_path}: step {st['step']} of {s.max_steps}, {st['elapsed_s'] / 60:.1f} min of "
            f"training so far, best held-out loss {st['best'][0]:.3f} (step {st['best'][1]})")
    else:
        open(log_path, "w").close()
    st["sessions"] += 1

    def save(why: str):
        save_state(state_path, {"params": params, "bias": bias, "opt_state": opt_state},
                   {**identity, "loop": st, "rng": rng.bit_generator.state, "saved_because": why})

    say(f"train stream {len(train_stream):,} tokens, held-out eval {evals.size:,} tokens; "
        f"batch {s.batch_size} x {s.seq_len}; budget {s.max_steps} steps"
        + (f" or {s.max_seconds / 60:.1f} min" if s.max_seconds > 0 else ""))
    log = open(log_path, "a")

    def record():
        hl = heldout_loss(params, bias)
        st["history"].append(hl)
        tl = float(np.mean(st["window_losses"])) if st["window_losses"] else float("nan")
        st["window_losses"] = []
        st["final_train_loss"] = tl
        row = {"step": st["step"], "tokens": st["tokens"], "train_loss": round(tl, 4), "heldout_loss": round(hl, 4),
               "lr": st["lr"], "elapsed_s": round(st["elapsed_s"], 1), "cpu_s": round(st["cpu_s"], 1),
               "expert_load_max_over_mean": round(st["imbalance"], 3)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        say(f"  step {st['step']:5d}  tokens {st['tokens'] / 1e6:6.2f}M  train {tl:.3f}  held-out {hl:.3f}  "
            f"lr {st['lr']:.2e}  load max/mean {st['imbalance']:.2f}  {st['elapsed_s'] / 60:.1f} min")
        if hl < st["best"][0]:
            st["best"] = [hl, st["step"]]
            save_params(ckpt_path, flat_arrays(bias, params),
                        {"step": st["step"], "heldout_loss": hl, "tokens": st["tokens"], "config": hf_config})

    # A polite stop (SIGTERM, e.g. a machine being handed back) saves the state first.
    stop_signal = []
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_signal.append(True))
    try:
        t_wall, t_cpu = time.perf_counter(), time.process_time()

        def tick():  # compute seconds, summed over sessions (compilation included)
            nonlocal t_wall, t_cpu
            now_wall, now_cpu = time.perf_counter(), time.process_time()
            st["elapsed_s"] += now_wall - t_wall
            st["cpu_s"] += now_cpu - t_cpu
            t_wall, t_cpu = now_wall, now_cpu

        if st["step"] == 0 and not st["history"]:
            record()
        t_saved = time.perf_counter()
        while st["stop_reason"] is None:
            if st["step"] >= s.max_steps:
                st["stop_reason"] = "max_steps"
                break
            if s.max_seconds > 0 and st["elapsed_s"] >= s.max_seconds:
                st["stop_reason"] = "max_minutes"
                break
            if stop_signal:
                tick()
                save("SIGTERM")
                say(f"stopped by SIGTERM at step {st['step']}; the state is saved in {state_path}")
                break
            st["lr"] = lr_at(s, st["step"], st["elapsed_s"])
            params, opt_state, bias, loss, imb = train_step(params, opt_state, bias, batch(), jnp.float32(st["lr"]))
            st["step"] += 1
            st["tokens"] += s.batch_size * s.seq_len
            st["window_losses"].append(float(loss))
            st["imbalance"] = float(imb)
            tick()
            if st["step"] % 25 == 0:
                say(f"    step {st['step']} loss {np.mean(st['window_losses'][-25:]):.3f} lr {st['lr']:.2e} "
                    f"({st['elapsed_s'] / 60:.1f} min, {st['cpu_s'] / 60:.1f} CPU min)")
            if st["step"] % s.eval_every_steps == 0 or st["step"] == s.max_steps:
                record()
                h, p = st["history"], s.patience
                if len(h) > p and min(h[:-p]) - min(h[-p:]) < s.flat_delta:
                    st["stop_reason"] = "held-out loss flattened"
                tick()
                save(f"evaluated at step {st['step']}")
                t_saved = time.perf_counter()
            elif time.perf_counter() - t_saved >= s.checkpoint_every_seconds:
                save(f"{s.checkpoint_every_seconds:.0f} s since the last save")
                t_saved = time.perf_counter()
        if st["stop_reason"] is not None:
            if st["window_losses"]:
                record()
                tick()
            save(f"finished: {st['stop_reason']}")
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        log.close()
    return {
        "params": n_params, "active_params": active_params(cfg, flat0), "steps": st["step"], "tokens": st["tokens"],
        "best_heldout_loss": st["best"][0], "best_step": st["best"][1],
        "final_train_loss": st.get("final_train_loss", float("nan")),
        "final_heldout_loss": st["history"][-1] if st["history"] else float("nan"),
        "stop_reason": st["stop_reason"] or "interrupted", "wall_s": st["elapsed_s"], "cpu_s": st["cpu_s"],
        "sessions": st["sessions"], "session_wall_s": time.perf_counter() - t_start,
        "settings": s.__dict__, "config": hf_config,
    }
