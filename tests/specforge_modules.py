"""SpecForge's own training modules as test oracles, imported on a CPU host.

SpecForge is installed without its dependencies (`make setup`: ``pip install --no-deps``; its
package pins a CUDA torch and a serving stack). Two of the modules its trainer step runs through
import packages the dev install lacks, for code a CPU run never reaches: ``specforge.core.loss``
imports Triton for its GPU loss kernel, ``specforge.data.utils`` imports ``datasets`` for a type.
They are imported here with a placeholder standing in for the missing package during that one
import (a real installation is used where present), and with ``torch.compile`` as the identity
while SpecForge's modules load: its reference loss and target-probability functions run eagerly
(on CPU, inductor would need a C compiler and minutes). The Triton loss (``LogSoftmaxLoss``) is
replaced by the same file's reference ``_compute_loss``: the mean over every position of the padded
batch of the masked soft-label cross-entropy, as the kernel computes it (forward and backward).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

import torch


@contextlib.contextmanager
def _placeholders(modules: dict):
    missing = {k: v for k, v in modules.items() if importlib.util.find_spec(k.split(".")[0]) is None}
    sys.modules.update(missing)
    try:
        yield
    finally:
        for k in missing:
            sys.modules.pop(k, None)


def _triton() -> dict:
    triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.jit = lambda fn: fn   # the kernels are defined, never launched
    language.constexpr = int
    triton.language = language
    return {"triton": triton, "triton.language": language}


def _datasets() -> dict:
    datasets = types.ModuleType("datasets")
    datasets.Dataset = object    # an annotation in specforge.data.utils
    return {"datasets": datasets}


def _load():
    import transformers.modeling_utils  # noqa: F401  (torch's own imports first, outside the placeholders)

    compile_ = torch.compile
    torch.compile = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    try:
        with _placeholders(_triton()):
            loss = importlib.import_module("specforge.core.loss")
        with _placeholders(_datasets()):
            importlib.import_module("specforge.data.utils")
        eagle3 = importlib.import_module("specforge.algorithms.eagle3.model")
        peagle = importlib.import_module("specforge.algorithms.peagle.model")
    finally:
        torch.compile = compile_

    class ReferenceLoss:
        apply = staticmethod(loss._compute_loss)

    eagle3.LogSoftmaxLoss = peagle.LogSoftmaxLoss = ReferenceLoss


_load()

from specforge.algorithms.common.collation import concatenate_features  # noqa: E402
from specforge.algorithms.eagle3.data import normalize_offline_sample  # noqa: E402
from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402
from specforge.algorithms.peagle import model as peagle_model  # noqa: E402
from specforge.data.utils import DataCollatorWithPadding  # noqa: E402
from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # noqa: E402
from specforge.modeling.draft import peagle as peagle_draft  # noqa: E402
from specforge.modeling.draft.peagle import PEagleDraftModel  # noqa: E402
from specforge.modeling.target.target_head import TargetHead  # noqa: E402
from specforge.runtime.contracts import TrainBatch  # noqa: E402
from specforge.training.strategies.base import Eagle3TrainStrategy, PEagleTrainStrategy  # noqa: E402

__all__ = ["DataCollatorWithPadding", "Eagle3TrainStrategy", "LlamaForCausalLMEagle3", "OnlineEagle3Model",
           "PEagleDraftModel", "PEagleTrainStrategy", "TargetHead", "TrainBatch", "concatenate_features",
           "normalize_offline_sample", "peagle_draft", "peagle_model", "target_head"]


def dense_flex_attention(query, key, value, block_mask, enable_gqa=False, **_):
    """SpecForge's P-EAGLE attention (flex attention under a block mask) computed densely from the
    same ``mask_mod``: torch's flex attention has no backward pass on CPU. Its forward is checked
    against ours as SpecForge runs it (test_peagle_specforge's logits tests)."""
    Q, KV = query.shape[-2], key.shape[-2]
    zero = torch.tensor(0)
    allowed = block_mask.mask_mod(zero, zero, torch.arange(Q)[:, None], torch.arange(KV)[None, :])
    if enable_gqa:
        key, value = (x.repeat_interleave(query.shape[1] // x.shape[1], dim=1) for x in (key, value))
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)


def target_head(tmp_path, lm_head_DV) -> TargetHead:
    """SpecForge's frozen target head (offline training's ``lm_head``) holding ``lm_head_DV``."""
    import json

    D, V = lm_head_DV.shape
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": D, "vocab_size": V,
                                                          "num_attention_heads": 1}))
    head = TargetHead(str(tmp_path)).float()
    with torch.no_grad():
        head.fc.weight.copy_(torch.as_tensor(lm_head_DV).T)
    head.freeze_weights()
    return head
