"""SpecForge's own ``PEagleDraftModel`` as the oracle, both ways: it loads our export strictly and
computes our logits; we load its checkpoint and compute its logits. Its attention is its own
(flex attention under a block mask); the rollout rule fed to it is the torch reference's of
test_peagle, because SpecForge's ``create_peagle_mask_mod`` sits in a module that imports triton
(absent from CPU hosts). Skipped where SpecForge is not installed: its
package pins a torch build of its own, so it is installed without dependencies
(``pip install --no-deps specforge``) next to the CPU torch of the [dev] extra."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from eagle3_jax.drafts.loaded import host_params
from eagle3_jax.drafts.peagle.checkpoint import read_peagle_state, write_peagle
from eagle3_jax.drafts.peagle.config import PEagleConfig
from eagle3_jax.drafts.peagle.model import PEagleDraft
from tests.test_peagle import ANCHOR, DEPTH, MASK_ID, _ours, random_draft, tiny_config

peagle = pytest.importorskip("specforge.modeling.draft.peagle")


def _specforge_model(config_dir):
    from transformers import LlamaConfig

    model = peagle.PEagleDraftModel(LlamaConfig.from_pretrained(str(config_dir))).float().eval()
    return model


def _specforge_logits(model, ids, aux, anchor=ANCHOR, depth=DEPTH):
    """The steps of SpecForge's P-EAGLE training forward up to the logits, on its module's methods."""
    from torch.nn.attention.flex_attention import create_block_mask

    anchor, depth = torch.as_tensor(anchor), torch.as_tensor(depth)
    pos = anchor + depth
    known = depth == 0
    tok = torch.where(known, torch.as_tensor(ids)[pos], torch.tensor(MASK_ID))
    hid = torch.where(known[:, None], torch.as_tensor(aux)[pos], model.mask_hidden.reshape(1, -1))

    def mask_mod(_b, _h, q, kv):
        return ((depth[kv] == 0) & (anchor[kv] <= anchor[q])) | ((anchor[kv] == anchor[q]) & (depth[kv] <= depth[q]))

    block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=len(pos), KV_LEN=len(pos), device="cpu")
    with torch.no_grad():
        h = model.backbone(model.embed_input_ids(tok[None]), model.project_hidden_states(hid[None]),
                           attention_mask=block, position_ids=pos[None])
        return model.compute_logits(h)[0].numpy()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(5)
    return rng.integers(0, 100, 16), rng.standard_normal((16, 72)).astype(np.float32)


def test_specforge_loads_our_export_strictly_and_agrees(tmp_path, inputs):
    cfg = tiny_config()
    ours = random_draft(cfg, seed=1)
    write_peagle(tmp_path / "d", cfg, host_params(ours), aux_layer_ids=(0, 1, 2))
    theirs = _specforge_model(tmp_path / "d")
    theirs.load_state_dict(load_file(str(tmp_path / "d" / "model.safetensors")), strict=True)
    ids, aux = inputs
    ref = _specforge_logits(theirs, ids, aux)
    assert np.abs(_ours(ours, ids, aux) - ref).max() / np.abs(ref).max() < 1e-4


def test_we_load_specforges_checkpoint_and_agree(tmp_path, inputs):
    cfg = tiny_config()
    config_dir = tmp_path / "sf"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    torch.manual_seed(0)
    theirs = _specforge_model(config_dir)
    # their norms start at ones and d2t at zeros: perturb them so a swap would show
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
        theirs.d2t.copy_(torch.randint(0, 60, theirs.d2t.shape))
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(config_dir / "model.safetensors"))
    theirs.config.save_pretrained(str(config_dir))   # the config SpecForge itself writes (no mask id)

    loaded_cfg = PEagleConfig.from_path(config_dir, mask_token_id=MASK_ID)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: PEagleDraft(loaded_cfg, 3, jnp.float32, None)))
    ours = nnx.merge(graphdef, read_peagle_state(config_dir, loaded_cfg, abstract, 3))
    np.testing.assert_array_equal(np.asarray(ours.d2t[...]), theirs.d2t.numpy())
    ids, aux = inputs
    ref = _specforge_logits(theirs, ids, aux)
    assert np.abs(_ours(ours, ids, aux) - ref).max() / np.abs(ref).max() < 1e-4
