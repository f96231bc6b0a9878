"""Stage 6 (target): write the trained target in Hugging Face layout and check it two ways.

The weights go through the product's own name map (``target_map.iter_hf_tensors``) and streaming
writer, in bf16 except the router's correction bias, which DeepSeek-V3 checkpoints keep in fp32.
Then the exported directory is read back by ``eagle3_jax.load_target`` and by transformers'
``DeepseekV3ForCausalLM``, and both must produce the same greedy continuation of a held-out prompt.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np

KEEP_FP32 = ("e_score_correction_bias",)
NEAR_TIE = 1e-3
# Both sides compute in float32 from the same bf16 weights; only summation order differs.
MAX_LOGIT_DIFF = 1e-2


def export_target(hf_config: dict, flat: dict, tokenizer_dir: str, out_dir: str) -> list[str]:
    """Writes config.json, generation_config.json, model.safetensors and the tokenizer files to
    ``out_dir`` (replaced whole once complete, so a crash never leaves half a model)."""
    from eagle3_jax.checkpoint.safetensors_writer import CheckpointWriter
    from eagle3_jax.checkpoint.staging import staged_dir, write_json_atomic
    from eagle3_jax.checkpoint.target_map import iter_hf_tensors
    from eagle3_jax.config import TargetConfig

    cfg = TargetConfig.from_hf_dict(hf_config, where="demo target config")
    with staged_dir(out_dir, overwrite=True) as tmp:
        with CheckpointWriter(tmp) as writer:
            for name, arr in iter_hf_tensors(cfg, flat):
                dtype = np.float32 if name.endswith(KEEP_FP32) else ml_dtypes.bfloat16
                writer.add(name, np.asarray(arr, np.float32).astype(dtype))
        write_json_atomic(tmp / "config.json", hf_config, fsync=False)
        write_json_atomic(tmp / "generation_config.json", {"bos_token_id": hf_config["bos_token_id"],
                                                           "eos_token_id": hf_config["eos_token_id"],
                                                           "do_sample": False}, fsync=False)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), tmp / name)
    return sorted(os.listdir(out_dir))


def verify(target_dir: str, prompt: str, max_new: int, say=print) -> dict:
    """Greedy continuations from our loader and from transformers must agree token for token.

    Both also score prompt + our continuation in one teacher-forced pass; the largest logit
    difference is reported, and a divergence counts as a failure unless it happens where the two
    best tokens are within ``NEAR_TIE`` (float32 summation order can flip an exact tie).
    """
    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer

    import eagle3_jax as e3

    tok = Tokenizer.from_file(os.path.join(target_dir, "tokenizer.json"))
    with open(os.path.join(target_dir, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    prompt_ids = tok.encode(prompt).ids

    target = e3.load_target(target_dir, dtype="float32")
    gen = e3.Generator(target, None, max_len=len(prompt_ids) + max_new + 1)
    ours = gen.generate([prompt_ids], max_new_tokens=max_new, eos_token_ids=(eos,)).tokens[0]

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        theirs = out[0, len(prompt_ids):].tolist()
        full = prompt_ids + ours
        ref_logits = model(torch.as_tensor([full], dtype=torch.long)).logits[0].numpy()
    our_logits = np.asarray(target.forward(np.asarray([full], np.int32)).logits[0])
    max_diff = float(np.abs(our_logits - ref_logits).max())

    same = ours == theirs
    near_tie = False
    if not same:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        row = ref_logits[len(prompt_ids) - 1 + first]
        top2 = np.sort(row)[-2:]
        near_tie = first < min(len(ours), len(theirs)) and float(top2[1] - top2[0]) < NEAR_TIE
    text = tok.decode(ours)
    say("held-out prompt:\n" + prompt.rstrip("\n"))
    say("greedy continuation (eagle3_jax.load_target):\n" + text)
    say(f"teacher-forced logits vs transformers: max |diff| {max_diff:.2e} over {len(full)} positions")
    if same:
        say(f"transformers DeepseekV3ForCausalLM greedy: identical ({len(ours)} tokens)")
    else:
        say(f"transformers DeepseekV3ForCausalLM greedy differs from generated token {first}"
            + (" (a near-tie of the two best tokens)" if near_tie else "") + ":\n" + tok.decode(theirs))
    return {"prompt": prompt, "continuation": text, "tokens": len(ours), "transformers_match": same,
            "near_tie": near_tie, "max_logit_diff": max_diff, "ok": (same or near_tie) and max_diff < MAX_LOGIT_DIFF}
