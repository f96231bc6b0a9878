"""Data-parallel attention: attention's rows and both KV caches split over data x expert (the chips
that hold different experts), the MoE still expert-parallel, the output still target-only greedy's."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eagle3_jax as e3
from eagle3_jax import sharding
from eagle3_jax.sharding import sharding_for
from eagle3_jax.speculative.generate import DecodeProgram, generate_loop
from eagle3_jax.speculative.session import SamplingSettings

MESH = "data=2,expert=4,tensor=1"
B, CAPACITY = 8, 40


@pytest.fixture(scope="module")
def prompts(tiny_target):
    # Eight rows of unequal lengths, so each of the mesh's 8 devices holds one row of attention.
    rng = np.random.default_rng(3)
    return [rng.integers(2, tiny_target.config.vocab_size, size=n).tolist() for n in (6, 9, 4, 12, 7, 5, 10, 8)]


def _dims(spec, ndim):
    return tuple(frozenset(() if e is None else e if isinstance(e, tuple) else (e,))
                 for e in tuple(spec) + (None,) * (ndim - len(spec)))


def test_attention_rows_split_over_data_and_expert_with_fallbacks(caplog):
    mesh = e3.make_mesh(MESH)
    axes = (None, "attn_batch", "cache_seq", "kv_lora")
    assert _dims(sharding_for(mesh, axes, (3, 8, 16, 4)).spec, 4)[1] == {"data", "expert"}
    # 4 rows on 2 x 4 devices: the data axis alone divides them; 3 rows: nothing does. Both say so
    # (each fallback is logged once a process: forget those an earlier test of this worker logged).
    sharding._fallbacks_logged.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3_jax"):
        assert _dims(sharding_for(mesh, axes, (3, 4, 16, 4)).spec, 4)[1] == {"data"}
        assert _dims(sharding_for(mesh, axes, (3, 3, 16, 4)).spec, 4)[1] == frozenset()
    assert "splitting it over ('data',) only" in caplog.text
    assert "replicating that dimension" in caplog.text


def test_compiled_caches_hold_one_row_per_device(tiny_target_dir, trained_draft_dir):
    mesh = e3.make_mesh(MESH)
    target = e3.load_target(tiny_target_dir, mesh=mesh)
    draft = e3.load_draft(trained_draft_dir, target)
    with jax.set_mesh(mesh):
        program = generate_loop.lower(
            target.graphdef, target.state, draft.graphdef, draft.state, jnp.asarray(draft.aux_layer_ids),
            jnp.zeros((B, 8), jnp.int32),
            jnp.full((B,), 8, jnp.int32), jax.random.key(0), SamplingSettings().traced(8),
            program=DecodeProgram(batch_size=B, max_len=CAPACITY, num_draft_tokens=2)).compile()
    out = {jax.tree_util.keystr(p).lstrip("."): (s, x.shape) for (p, s), x in zip(
        jax.tree_util.tree_leaves_with_path(program.output_shardings), jax.tree_util.tree_leaves(program.out_info))}
    for name, row_dim in (("tcache.latent_LBSC", 1), ("tcache.rope_LBSP", 1), ("dcache.k_BSGH", 0),
                          ("dcache.v_BSGH", 0)):
        sharding, shape = out[name]
        assert _dims(sharding.spec, len(shape))[row_dim] == {"data", "expert"}, f"{name}: {sharding.spec}"
        assert sharding.shard_shape(shape)[row_dim] == 1, f"{name}: {B} rows on 8 devices, one each"
    # the MoE hands its rows back reduce-scattered over expert (moe.py), not all-reduced and sliced
    assert "reduce-scatter" in program.as_text()


def test_lossless_with_rows_split_over_8_devices(tiny_target, tiny_target_dir, trained_draft_dir, prompts):
    reference = e3.Generator(tiny_target, None, max_len=CAPACITY).generate(prompts, 20)
    mesh = e3.make_mesh(MESH)
    target = e3.load_target(tiny_target_dir, mesh=mesh)
    draft = e3.load_draft(trained_draft_dir, target)
    res = e3.Generator(target, draft, num_draft_tokens=3, max_len=CAPACITY).generate(prompts, 20)
    assert res.tokens == reference.tokens
    assert res.finish_reasons == reference.finish_reasons
    assert res.stats.mean_accept_length > 1.0   # the draft's tokens are accepted: multi-token rounds ran
