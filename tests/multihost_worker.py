"""One process of the 2-process test: 4 local CPU devices, a mesh over all 8, greedy generation."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import eagle3_jax as e3  # noqa: E402
from eagle3_jax import distributed  # noqa: E402


def main():
    port, pid, target_dir, draft_dir, mesh, out = sys.argv[1:7]
    assert distributed.initialize(f"127.0.0.1:{port}", 2, int(pid))
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    prompts = json.loads(os.environ["EAGLE3_TEST_PROMPTS"])
    target = e3.load_target(target_dir, mesh=e3.make_mesh(mesh))
    draft = e3.load_draft(draft_dir, target)
    res = e3.Generator(target, draft, num_draft_tokens=3, max_len=40).generate(prompts, 16)
    ref = e3.Generator(target, None, max_len=40).generate(prompts, 16)
    if distributed.is_writer():
        with open(out, "w") as f:
            json.dump({"spec": res.tokens, "target_only": ref.tokens}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
