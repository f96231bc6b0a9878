"""DFlash in the decode loop and its objective: greedy output equals target-only decoding token for
token (one block pass proposes, the target verifies, the existing acceptance keeps it lossless), for
a random draft and for one trained here on SpecForge's objective; that objective equals SpecForge's
``OnlineDFlashModel`` loss and accuracy on the same batch and anchors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax.drafts.dflash.checkpoint import LoadedDFlash
from eagle3_jax.drafts.dflash.checkpoint import build as build_dflash_draft
from eagle3_jax.drafts.dflash.config import DFlashConfig
from eagle3_jax.drafts.dflash.objective import dflash_terms, terms_loss
from tests import spec_fixtures

BLOCK, MASK_ID = 5, 3


def sample_anchors(key, loss_mask_BS: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """``sample_anchors_host``'s rule in jax over a batch: (anchors [B, N], kept [B, N])."""
    B, S = loss_mask_BS.shape
    valid_BC = (loss_mask_BS[:, :-1] > 0.5) & (loss_mask_BS[:, 1:] > 0.5)   # C = S - 1 candidates
    score_BC = jnp.where(valid_BC, jax.random.uniform(key, valid_BC.shape), 2.0)
    picked_BN = jnp.argsort(score_BC, axis=1)[:, :num_anchors]
    kept_BN = jnp.arange(num_anchors)[None, :] < jnp.sum(valid_BC, axis=1, keepdims=True)
    anchors_BN = jnp.sort(jnp.where(kept_BN, picked_BN, S), axis=1)
    kept_BN = anchors_BN < S
    return jnp.where(kept_BN, anchors_BN, 0), kept_BN


def dflash_loss(logits_BTV, ids_BS, loss_mask_BS, anchor_BN, keep_BN, block: int, decay_gamma: float | None = None):
    """(loss, accuracy) of the blocks' logits [B, N * block, V] (float32)."""
    t = dflash_terms(logits_BTV, ids_BS, loss_mask_BS, anchor_BN, keep_BN, block, decay_gamma)
    return terms_loss(t), jnp.sum(t["hits_K"]) / jnp.maximum(jnp.sum(t["scored_K"]), 1)


def tiny_dflash_config(tcfg, layer_types=("full_attention", "sliding_attention")) -> DFlashConfig:
    return DFlashConfig.from_hf_dict({
        "architectures": ["DFlashDraftModel"], "hidden_size": tcfg.hidden_size, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types), "sliding_window": 6, "vocab_size": tcfg.vocab_size, "block_size": BLOCK,
        "rope_theta": 10000.0, "max_position_embeddings": 256,
        "dflash_config": {"target_layer_ids": [0, 1, 2], "mask_token_id": MASK_ID}})


def train_dflash(target, draft: LoadedDFlash, seqs, steps=150, lr=3e-3, batch=8, anchors=6, seed=0):
    """SpecForge's DFlash objective on the target's own greedy continuations (every token supervised)."""
    outs = [target.forward(seqs[i:i + batch], aux_layer_ids=draft.aux_layer_ids) for i in range(0, len(seqs), batch)]
    aux = np.concatenate([np.asarray(o.aux_hidden) for o in outs])
    mask = np.ones(seqs.shape, np.float32)
    embed, head = target.model.embed_tokens[...], target.model.lm_head[...]
    graphdef, params, rest = nnx.split(nnx.merge(draft.graphdef, draft.state), nnx.Param, ...)
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    def loss_fn(params, ids, a, m, key):
        model = nnx.merge(graphdef, params, rest)
        anchor, keep = sample_anchors(key, m, anchors)
        out = model.forward_blocks(a, embed, ids, anchor, keep)
        return dflash_loss(jnp.einsum("btd,dv->btv", out, head), ids, m, anchor, keep, BLOCK)

    @jax.jit
    def step(params, opt_state, ids, a, m, key):
        (loss, acc), g = jax.value_and_grad(loss_fn, has_aux=True)(params, ids, a, m, key)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss, acc

    rng, key = np.random.default_rng(seed), jax.random.PRNGKey(seed)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(seqs), size=batch, replace=False)
        key, k = jax.random.split(key)
        params, opt_state, loss, acc = step(params, opt_state, seqs[idx], aux[idx], mask[idx], k)
        losses.append(float(loss))
    return LoadedDFlash(nnx.merge(graphdef, params, rest), target, draft.aux_layer_ids), losses, float(acc)


def test_objective_equals_specforges(tiny_target, tmp_path):
    torch = pytest.importorskip("torch")
    family = pytest.importorskip("specforge.algorithms.common.dflash_family_model")
    from tests.test_dflash import _specforge_draft

    model = _specforge_draft(tmp_path / "sf", tiny_target.config, ["full_attention", "sliding_attention"], seed=2)
    draft = e3.load_draft(tmp_path / "sf", tiny_target, dtype="float32")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, size=(2, 14))
    loss_mask = np.ones((2, 14), np.float32)
    loss_mask[0, :3] = 0
    loss_mask[1, 11:] = 0   # the last block of row 1 runs into unsupervised positions
    anchors, keep = np.array([[3, 6, 10], [0, 5, 9]]), np.array([[True, True, True], [True, True, False]])
    aux = np.asarray(tiny_target.forward(ids, aux_layer_ids=draft.aux_layer_ids).aux_hidden, np.float32)
    lm_head = torch.nn.Linear(64, 256, bias=False)
    embed = torch.nn.Embedding(256, 64)
    with torch.no_grad():
        lm_head.weight.copy_(torch.as_tensor(np.asarray(tiny_target.model.lm_head[...]).T))
        embed.weight.copy_(torch.as_tensor(np.asarray(tiny_target.model.embed_tokens[...])))
    for gamma in (None, 3.0):
        theirs = family.OnlineDFlashModel(model, lm_head, embed, mask_token_id=5, block_size=4,
                                          attention_backend="sdpa", num_anchors=3, loss_decay_gamma=gamma)
        theirs._sample_anchor_positions = lambda *a, **k: (torch.as_tensor(anchors), torch.as_tensor(keep))
        with torch.no_grad():
            ref_loss, ref_acc, _ = theirs(torch.as_tensor(ids), torch.as_tensor(aux), torch.as_tensor(loss_mask))
        _, logits = draft.forward_blocks(ids, aux, anchors, keep)
        loss, acc = dflash_loss(logits, jnp.asarray(ids), jnp.asarray(loss_mask), jnp.asarray(anchors),
                                jnp.asarray(keep), 4, gamma)
        print(f"DFlash objective gamma={gamma}: ours {float(loss):.7f} specforge {float(ref_loss):.7f}")
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
        assert float(acc) == pytest.approx(float(ref_acc), abs=1e-7)


def test_anchors_are_valid_sorted_and_fill_with_dropped_blocks():
    mask = np.zeros((2, 12), np.float32)
    mask[0, 2:9] = 1   # valid anchors 2..7 (the token after must be supervised too)
    mask[1, 10:] = 1   # one valid anchor: 10
    anchors, keep = (np.asarray(a) for a in sample_anchors(jax.random.PRNGKey(0), jnp.asarray(mask), 4))
    assert keep[0].all() and set(anchors[0]) <= set(range(2, 8)) and list(anchors[0]) == sorted(anchors[0])
    assert list(keep[1]) == [True, False, False, False] and anchors[1, 0] == 10


def test_serving_pass_equals_the_training_forward(tiny_target):
    """The decode loop's pass (context keys from the cache: blockwise over the filled slots for full
    layers, the gathered window for sliding ones) gives the training forward's outputs for a block
    at the same anchor; anchors before and past the window, and a stale slot after one of them."""
    draft = build_dflash_draft(tiny_dflash_config(tiny_target.config), tiny_target, seed=4, dtype="float32")
    model = nnx.merge(draft.graphdef, draft.state)
    rng = np.random.default_rng(2)
    S = 20
    ids = rng.integers(0, 256, size=(3, S))
    aux = jnp.asarray(rng.standard_normal((3, S, 3 * 64)), jnp.float32)
    anchors = jnp.asarray([3, 11, 15])
    embed = tiny_target.model.embed_tokens[...]
    cache = model.write_context(aux, jnp.broadcast_to(jnp.arange(S), (3, S)), model.init_cache(3, 32))
    served = model.propose(jnp.asarray(ids)[jnp.arange(3), anchors], anchors, cache, embed)
    trained = model.forward_blocks(aux, embed, jnp.asarray(ids), anchors[:, None], jnp.ones((3, 1), bool))
    err = float(jnp.max(jnp.abs(served - trained)) / jnp.max(jnp.abs(trained)))
    print(f"DFlash serving pass vs training forward: {err:.2e}")
    assert err <= 1e-5


@pytest.fixture(scope="module")
def prompts_and_reference(tiny_target):
    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=32)
    prompts = [seqs[i, :n].tolist() for i, n in enumerate([6, 9, 12, 7, 6, 10, 8, 11])]
    return seqs, prompts, e3.Generator(tiny_target, None, max_len=48).generate(prompts, 24)


def test_random_dflash_draft_is_lossless(tiny_target, prompts_and_reference):
    _, prompts, ref = prompts_and_reference
    draft = build_dflash_draft(tiny_dflash_config(tiny_target.config), tiny_target, seed=1)
    with pytest.warns(e3.AcceptanceCollapseWarning):
        res = e3.Generator(tiny_target, draft, num_draft_tokens=BLOCK - 1, max_len=48).generate(prompts, 24)
    assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
    with pytest.raises(e3.ConfigError, match="block_size - 1 = 4"):
        e3.Generator(tiny_target, draft, num_draft_tokens=BLOCK, max_len=48)


def test_trained_dflash_draft_is_lossless_and_accepted(tiny_target, prompts_and_reference, tmp_path):
    seqs, prompts, ref = prompts_and_reference
    draft = build_dflash_draft(tiny_dflash_config(tiny_target.config), tiny_target, seed=2)
    draft, losses, acc = train_dflash(tiny_target, draft, seqs)
    print(f"DFlash training: loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}, last accuracy {acc:.2f}")
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    for k, batch in ((BLOCK - 1, 8), (2, 1)):
        res = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=48, batch_size=batch).generate(prompts, 24)
        assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
        print(f"DFlash K={k} batch={batch}: mean accept length {res.stats.mean_accept_length:.2f}, "
              f"accepted per position {res.stats.accepted_per_position}")
        assert res.stats.mean_accept_length > 1.3 and res.stats.accepted_per_position[1] > 0, res.stats
    # export in SpecForge's layout and load back: the same weights
    e3.save_draft(draft, tmp_path / "d")
    again = e3.load_draft(tmp_path / "d", tiny_target)
    for (p, a), (_, b) in zip(nnx.to_flat_state(draft.state), nnx.to_flat_state(again.state)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))


def test_serve_cli_runs_a_dflash_draft(tmp_path, tiny_target, tiny_target_dir):
    """serve.py with a DFlash draft directory: preflight knows the kind, the job's outputs equal
    target-only generation."""
    from tests.serve_fixtures import (ModelCache, byte_target_dir, expected_text_records, prompt_rows, read_jsonl,
                                      serve, write_jsonl)

    target_dir = byte_target_dir(tiny_target_dir, tmp_path / "target")
    e3.save_draft(build_dflash_draft(tiny_dflash_config(tiny_target.config), tiny_target, seed=1), tmp_path / "dflash")
    models = ModelCache(tiny_target, {str(tmp_path / "dflash"): e3.load_draft(tmp_path / "dflash", tiny_target)})
    inp = write_jsonl(tmp_path / "in.jsonl", prompt_rows())
    assert serve(models, target_dir, inp, tmp_path / "out.jsonl", tmp_path / "dflash") == 0
    expected = expected_text_records(tiny_target, target_dir, prompt_rows())
    records = read_jsonl(tmp_path / "out.jsonl")
    assert len(records) == len(expected)
    for r in records:
        assert (r["text"], r["num_tokens"], r["finish_reason"]) == expected[r["id"]], r["id"]
