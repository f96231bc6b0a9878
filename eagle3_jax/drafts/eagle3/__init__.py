"""EAGLE-3, the chain draft (SpecForge / SGLang ``LlamaForCausalLMEagle3``): one decoder layer over
the fused target aux states, each of a round's K guesses fed back for the next (``propose``),
trained by training-time test (``train.ttt``, loop ``train.trainer``)."""

from eagle3_jax.drafts.eagle3 import layout
from eagle3_jax.drafts.eagle3.config import DRAFT_ARCHITECTURES, DraftConfig
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.drafts.eagle3.propose import propose_chain
from eagle3_jax.drafts.kind import DraftKind, catch_up_by_rereading


KIND = DraftKind(
    name="eagle3", title="EAGLE-3", architectures=DRAFT_ARCHITECTURES, config=DraftConfig, module=Draft,
    load=layout.load, build=layout.build, save=layout.save, wiring=layout.wiring, convert_table=layout.convert_table,
    propose=propose_chain, catch_up=catch_up_by_rereading,
    trainer="trainer:Trainer", train_config=lambda d, cfg, from_file, where: DraftConfig.from_hf_dict(d, where=where))
