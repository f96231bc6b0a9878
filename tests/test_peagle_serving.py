"""A P-EAGLE draft in the jitted decode loop: greedy output equals target-only token for token."""

import numpy as np
import pytest
from flax import nnx

import eagle3_jax as e3
from eagle3_jax import drafts
from eagle3_jax.drafts.loaded import host_params
from eagle3_jax.drafts.peagle.checkpoint import build_peagle_draft, write_peagle
from eagle3_jax.drafts.peagle.config import PEagleConfig
from tests.peagle_fixtures import load_peagle_draft
from tests.test_spec_sampling import TEMP, TOP_K, _chi2_pvalue, _sample_pairs, exact_joint, prompt  # noqa: F401


def peagle_config(target_cfg, **extra) -> PEagleConfig:
    d = {"architectures": ["PEagleDraftModel"], "model_type": "llama", "hidden_size": 48, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "num_hidden_layers": 2,
         "vocab_size": target_cfg.vocab_size, "draft_vocab_size": 64, "target_hidden_size": target_cfg.hidden_size,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "mask_token_id": 3,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}
    d.update(extra)
    return PEagleConfig.from_hf_dict(d)


@pytest.fixture(scope="module")
def prompts(tiny_target):
    rng = np.random.default_rng(1)
    lengths = [6, 3, 9, 5, 7, 4, 8, 6]
    return [rng.integers(2, tiny_target.config.vocab_size, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def peagle_dir(tiny_target, tmp_path_factory):
    """A random P-EAGLE draft exported in SpecForge's layout (non-trivial vocab map: id i -> 2i + 1)."""
    import jax.numpy as jnp

    draft = build_peagle_draft(peagle_config(tiny_target.config), tiny_target, seed=3)
    draft.model.d2t[...] = jnp.arange(64, dtype=jnp.int32) + 1
    path = tmp_path_factory.mktemp("peagle") / "draft"
    write_peagle(path, draft.config, host_params(draft.model), draft.aux_layer_ids)
    return path


@pytest.fixture(scope="module")
def reference(tiny_target, prompts):
    return e3.Generator(tiny_target, None, max_len=40).generate(prompts, 20)


@pytest.mark.parametrize("k,batch", [(1, 8), (8, 1)])
def test_random_peagle_is_lossless(tiny_target, peagle_dir, prompts, reference, k, batch):
    draft = e3.load_draft(peagle_dir, tiny_target)   # dispatches on the architecture
    assert drafts.of_module(draft.model).name == "peagle"
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=40, batch_size=batch)
    res = gen.generate(prompts if batch > 1 else prompts[:2], 20)
    assert res.tokens == reference.tokens[:len(res.tokens)]
    assert res.finish_reasons == reference.finish_reasons[:len(res.tokens)]


@pytest.fixture(scope="module")
def trained(tiny_target):
    """(trained draft, the corpus it saw): see peagle_fixtures."""
    from tests import peagle_fixtures, spec_fixtures

    seqs = spec_fixtures.target_greedy_corpus(tiny_target, n_prompts=32)
    draft = build_peagle_draft(peagle_config(tiny_target.config, draft_vocab_size=tiny_target.config.vocab_size),
                               tiny_target, seed=5)
    draft, losses, acc = peagle_fixtures.train_peagle_on_target(tiny_target, draft, seqs)
    # soft labels: the loss floor is the target's entropy, so learning shows in top-1 agreement
    assert np.mean(losses[-20:]) < np.mean(losses[:20]) and acc[0] > 0.5, (losses[:3], losses[-3:], acc)
    print("P-EAGLE fixture: loss", losses[0], "->", losses[-1], "top-1 agreement by depth", acc)
    return draft, seqs


@pytest.mark.parametrize("k,batch", [(3, 8), (6, 1)])
def test_trained_peagle_is_lossless_and_accepted(tiny_target, trained, k, batch):
    draft, seqs = trained
    # rows the draft saw, cut at different lengths (in distribution, so drafts are accepted)
    prompts = [seqs[i, :n].tolist() for i, n in enumerate([6, 9, 12, 7, 6, 10, 8, 11])][:batch]
    ref = e3.Generator(tiny_target, None, max_len=48).generate(prompts, 24)
    res = e3.Generator(tiny_target, draft, num_draft_tokens=k, max_len=48, batch_size=batch).generate(prompts, 24)
    assert res.tokens == ref.tokens
    assert res.finish_reasons == ref.finish_reasons
    # more than one token per round, and guesses past the first position are accepted too
    print(f"P-EAGLE K={k} batch={batch}: mean accept length {res.stats.mean_accept_length:.2f}, "
          f"accepted per position {res.stats.accepted_per_position}")
    assert res.stats.mean_accept_length > 1.3, res.stats
    assert res.stats.accepted_per_position[1] > 0, res.stats.accepted_per_position


def test_preflight_load_and_save_know_peagle(tiny_target, peagle_dir, tmp_path):
    import json

    from eagle3_jax import preflight
    from eagle3_jax.errors import ConfigError

    facts = preflight.check_pair(tiny_target.config, peagle_dir)
    assert isinstance(facts.draft, PEagleConfig) and facts.aux_layer_ids == (0, 1, 2)
    assert facts.fc_in_width == 3 * tiny_target.config.hidden_size
    draft = e3.load_draft(peagle_dir, tiny_target)
    e3.save_draft(draft, tmp_path / "again")
    again = e3.load_draft(tmp_path / "again", tiny_target)
    np.testing.assert_array_equal(np.asarray(again.model.mask_hidden[...]), np.asarray(draft.model.mask_hidden[...]))
    # a SpecForge export names no MASK token: preflight says so, loading asks for it
    cfg = json.loads((peagle_dir / "config.json").read_text())
    cfg.pop("mask_token_id")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(cfg))
    (bare / "model.safetensors").symlink_to(peagle_dir / "model.safetensors")
    assert any("mask_token_id" in n for n in preflight.check_pair(tiny_target.config, bare).notes)
    with pytest.raises(ConfigError, match="mask_token_id"):
        e3.load_draft(bare, tiny_target)
    assert load_peagle_draft(bare, tiny_target, mask_token_id=3).config.mask_token_id == 3
    # the wiring contracts hold for the new kind: a draft for a wider target is refused before any weight
    cfg["target_hidden_size"] = tiny_target.config.hidden_size * 2
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="target_hidden_size"):
        preflight.check_pair(tiny_target.config, bare)


def test_trained_peagle_sampling_matches_exact_distribution(tiny_target, trained, prompt, exact_joint):
    """T = 1, top-k 6: the first two new tokens' joint law equals the target's (chi-square), with
    K = 2 so the second guess is the parallel one (the MASK position)."""
    draft, _ = trained
    gen = e3.Generator(tiny_target, draft, num_draft_tokens=2, max_len=16)
    assert _chi2_pvalue(_sample_pairs(gen, prompt), exact_joint) > 1e-3
    res = gen.generate([prompt] * 64, 3, temperature=TEMP, top_k=TOP_K, seed=99)
    print(f"P-EAGLE T=1 K=2: accepted per position {res.stats.accepted_per_position}")
    assert sum(res.stats.accepted_per_position) > 0


def test_convert_round_trip(tiny_target, peagle_dir, tmp_path):
    """SpecForge layout -> our JAX checkpoint -> SpecForge layout: the same tensors, byte for byte;
    the converted checkpoint loads as the original does."""
    from tests.test_convert import assert_same_tensors, to_hf, to_jax

    meta = to_jax(peagle_dir, tmp_path / "p.jax")
    assert meta["kind"] == "draft" and meta["architecture"] == "PEagleDraftModel"
    to_hf(tmp_path / "p.jax", tmp_path / "p.back")
    assert_same_tensors(peagle_dir, tmp_path / "p.back")
    import json

    back = json.loads((tmp_path / "p.back" / "config.json").read_text())
    assert back["architectures"] == ["PEagleDraftModel"] and back["mask_token_id"] == 3
    a, b = e3.load_draft(peagle_dir, tiny_target), e3.load_draft(tmp_path / "p.jax", tiny_target)
    assert a.aux_layer_ids == b.aux_layer_ids
    for (pa, va), (pb, vb) in zip(nnx.to_flat_state(a.state), nnx.to_flat_state(b.state)):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(va[...]), np.asarray(vb[...]), err_msg=str(pa))


def test_trained_peagle_on_8_device_mesh(tiny_target, tiny_target_dir, trained, tmp_path):
    """The same draft, saved and loaded onto a data x expert x tensor mesh: the same greedy tokens."""
    draft, seqs = trained
    e3.save_draft(draft, tmp_path / "trained")
    target = e3.load_target(tiny_target_dir, mesh=e3.make_mesh("data=2,expert=2,tensor=2"))
    sharded = e3.load_draft(tmp_path / "trained", target)
    prompts = [seqs[i, :n].tolist() for i, n in enumerate([6, 9, 12, 7])]
    ref = e3.Generator(tiny_target, None, max_len=48).generate(prompts, 16)
    res = e3.Generator(target, sharded, num_draft_tokens=4, max_len=48).generate(prompts, 16)
    assert res.tokens == ref.tokens
    assert res.stats.mean_accept_length > 1.3


def test_auto_prices_peagle_rounds_and_stays_lossless(tiny_target, trained, monkeypatch):
    """``num_draft_tokens="auto"`` with a P-EAGLE draft: its round costs are probed with the P-EAGLE
    round programs (one draft pass a round), and greedy output equals target-only's."""
    from eagle3_jax.speculative import session as session_mod

    monkeypatch.setattr(session_mod, "PROBE_REPEATS", 1)
    probed = []
    real = session_mod.probe_costs
    monkeypatch.setattr(session_mod, "probe_costs", lambda s, *a: probed.append(drafts.of_module(s.draft.model).name)
                        or real(s, *a))
    draft, seqs = trained
    prompts = [s[:6].tolist() for s in seqs[:4]]
    expected = e3.Generator(tiny_target, None, max_len=40).generate(prompts, 16).tokens
    gen = e3.Generator(tiny_target, draft, num_draft_tokens="auto", max_draft_tokens=3, max_len=40, batch_size=2)
    assert gen.generate(prompts, 16).tokens == expected
    assert probed == ["peagle"]
    c = gen.draft_choice
    assert c.num_draft_tokens in (0, 1, 2, 3) and c.calibration_seconds > 0 and sum(c.rounds_per_k.values()) > 0
