"""Where the demo target's training step goes: the whole step, the forward alone, the 8k-vocabulary
head with its cross-entropy alone (forward and backward), and the step of a 2-layer model of the same
widths (the per-layer cost by difference).

    python benchmarks/probes/train_step_split.py [STEPS] [BATCH]
"""
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from tools.demo import lm  # noqa: E402

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
ids = jnp.asarray(np.random.default_rng(0).integers(2, 8192, size=(batch, 257)), jnp.int32)


def timed(f, *args):
    out = jax.block_until_ready(f(*args))   # compile
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out


for layers in (24, 2):
    hf = dict(lm.target_hf_config(8192, 0, 1, 256), num_hidden_layers=layers)
    s = lm.TrainSettings(batch_size=batch)
    cfg, model = lm.build_target(hf, 0, s.moe_kernel)
    graphdef, bias, params = nnx.split(model, nnx.PathContains("e_score_correction_bias"), nnx.Param)
    lm._STEP_FUNCTIONS.clear()
    tx, train_step, eval_step = lm.step_functions(hf, s, graphdef)
    opt_state = tx.init(params)
    step_s, _ = timed(lambda: train_step(params, opt_state, bias, ids, 1e-3))
    fwd_s, _ = timed(lambda: eval_step(params, bias, ids))
    print(f"{layers} layers: step {step_s:.2f} s, forward (loss) {fwd_s:.2f} s", flush=True)

embed = jnp.asarray(np.random.default_rng(1).normal(size=(8192, 256)) * 0.02, jnp.float32)
h = jnp.asarray(np.random.default_rng(2).normal(size=(batch, 256, 256)), jnp.float32)


@jax.jit
def head(embed, h):
    def loss(embed, h):
        return optax.softmax_cross_entropy_with_integer_labels(h @ embed.T, ids[:, 1:]).mean()
    return jax.grad(loss, argnums=(0, 1))(embed, h)


head_s, _ = timed(head, embed, h)
print(f"head + cross-entropy, forward and backward: {head_s:.2f} s", flush=True)
