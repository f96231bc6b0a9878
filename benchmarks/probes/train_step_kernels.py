"""The demo target's pre-training step (tools/demo/lm.py) under each differentiable expert kernel,
and with every routed expert computed densely (weights zero where not chosen: the same function,
4x the expert FLOPs at top-4 of 16, but two large matmuls instead of gathers and scatters).

    python benchmarks/probes/train_step_kernels.py [STEPS] [BATCH]

Prints seconds per step (median of STEPS after one compiling step) and the loss after the same
steps from the same start, which must agree across kernels.
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
from flax import nnx  # noqa: E402

from eagle3_jax.models import moe  # noqa: E402
from tools.demo import lm  # noqa: E402


def experts_dense(x_MD, idx_MK, weights_MK, w_gate_EDF, w_up_EDF, w_down_EFD, first_expert):
    E, D, F = w_gate_EDF.shape
    w_ME = jnp.zeros((x_MD.shape[0], E), x_MD.dtype).at[
        jnp.arange(x_MD.shape[0])[:, None], idx_MK - first_expert].add(weights_MK.astype(x_MD.dtype))
    g_MEF = jnp.einsum("md,edf->mef", x_MD, w_gate_EDF)
    u_MEF = jnp.einsum("md,edf->mef", x_MD, w_up_EDF)
    h_MEF = jax.nn.silu(g_MEF) * u_MEF * w_ME[..., None]
    return jnp.einsum("mef,efd->md", h_MEF, w_down_EFD)


moe.EXPERT_KERNELS["dense"] = experts_dense
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
hf = lm.target_hf_config(8192, 0, 1, 256)
ids = jnp.asarray(np.random.default_rng(0).integers(2, 8192, size=(batch, 257)), jnp.int32)
for kernel in ("padded_blocks", "dense", "ragged"):
    s = lm.TrainSettings(batch_size=batch, moe_kernel=kernel)
    cfg, model = lm.build_target(hf, 0, kernel)
    graphdef, bias, params = nnx.split(model, nnx.PathContains("e_score_correction_bias"), nnx.Param)
    tx, train_step, _ = lm.step_functions(hf, s, graphdef)
    opt_state = tx.init(params)
    times, losses = [], []
    for i in range(steps + 1):
        t = time.perf_counter()
        params, opt_state, bias, loss, _ = train_step(params, opt_state, bias, ids, 1e-3)
        losses.append(float(loss))
        times.append(time.perf_counter() - t)
    print(f"{kernel:>14}: {statistics.median(times[1:]):.2f} s/step (compile step {times[0]:.1f} s), "
          f"losses {' '.join(f'{x:.4f}' for x in losses)}", flush=True)
