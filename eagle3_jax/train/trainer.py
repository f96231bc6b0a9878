"""The training loop: the kind's jitted step on the mesh (AdamW, warmup-cosine, clipping), orbax
checkpoints that a restart resumes from, metrics, periodic acceptance eval, SpecForge export.

One optimizer step consumes ``grad_accum`` batches of ``batch_size`` rows, their gradients averaged
inside the step, so the step counter, the schedule and the checkpoints count optimizer steps. Rows
are sharded over the mesh's ``data`` axis; with several processes each reads only the rows its
devices hold, all save and restore the checkpoints together (``out_dir`` on a shared filesystem),
and process 0 alone writes the metrics log, the vocab map and the exported draft.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle3_jax import distributed, drafts
from eagle3_jax.checkpoint.staging import atomic_file
from eagle3_jax.config import resolve_dtype
from eagle3_jax.contracts import check_pairing
from eagle3_jax.drafts.loaded import LoadedDraft, placed
from eagle3_jax.errors import ConfigError, SettingsError
from eagle3_jax.loading import load_target, save_draft
from eagle3_jax.drafts.eagle3.model import Draft
from eagle3_jax.sharding import make_mesh, mesh_context, state_shardings, train_param_sharding
from eagle3_jax.train import data as data_lib, offline as offline_lib, pipeline as pipeline_lib
from eagle3_jax.train.config import TrainConfig, TrainPlan
from eagle3_jax.train.progress import StepReport, info as _info
from eagle3_jax.train.step import (OptimizerSpec, compiled_step, host_draws, init_optimizer, loss_spec, lr_schedule,
                                   train_step)
from eagle3_jax.train.ttt import simulated_acc_len
from eagle3_jax.train_serve import check_served_acceptance, tau_by_context
from eagle3_jax.train.vocab import VocabMap, build_vocab_map, load_or_build, token_counts

log = logging.getLogger("eagle3_jax")

# Keys a checkpoint cannot be resumed under if they changed: they alter the parameters' shapes,
# the data order, or what a step means (every draft kind's own settings among them).
RESUME_INVARIANTS = ("draft_kind", "draft_config_file", "draft", *(k.settings_key for k in drafts.KINDS if k.settings_key),
                     "aux_layer_ids", "draft_vocab_size", "max_len", "batch_size", "grad_accum", "seed", "dtype",
                     "hidden_source", "ttt_steps")
# Where and how the draft is written or the run reports: a finished run rerun with new ones re-exports.
OUTPUT_ONLY = ("export_dir", "export_dtype", "log_every", "save_every", "keep", "mesh")


@dataclass
class TrainResult:
    step: int
    finished: bool
    export_dir: str | None
    last_metrics: dict | None


class Trainer:
    """Builds what a run needs from a ``TrainConfig`` (and its ``TrainPlan``); resumes from its last checkpoint."""

    loaded_class = LoadedDraft   # what serving and export see of the trained draft

    def __init__(self, cfg: TrainConfig, progress: bool = True, plan: TrainPlan | None = None):
        import orbax.checkpoint as ocp

        plan = plan if plan is not None else cfg.resolve()
        tcfg = plan.target
        if cfg.mode != "train":
            raise ConfigError(f"Trainer runs mode=train; mode={cfg.mode} is handled by prepare_offline")
        self.cfg = cfg
        self.plan = plan
        self.progress = progress
        self.tcfg = tcfg
        self.aux_ids = plan.aux_ids
        self.dcfg = plan.draft
        self.mesh = make_mesh(cfg.mesh) if cfg.mesh is not None else None
        pipeline_lib.check_process_mesh(self.mesh)
        self.rows = pipeline_lib.local_rows(self.mesh, cfg.batch_size, cfg.grad_accum)   # [lo, hi) of each batch
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")

        # ---- where the target's states come from
        self.target = None
        self.tokenizer = None
        if cfg.hidden_source == "online":
            t0 = time.perf_counter()
            self.tokenizer = data_lib.load_tokenizer(cfg.target)
            examples = data_lib.read_examples(cfg.data, self.tokenizer, cfg.max_len, tcfg.vocab_size)
            _info("read %d training records from %s (%.1fs)", len(examples), cfg.data, time.perf_counter() - t0)
            self.source = pipeline_lib.TokenizedSource(examples, cfg.max_len)
            t0 = time.perf_counter()
            self.target = self._load_target()
            _info("loaded target %s (%s) in %.1fs", cfg.target, cfg.resolved_target_dtype, time.perf_counter() - t0)
            self.embed_VD, self.lm_head_DV = offline_lib.target_head(self.target.model)
        else:
            self.source = offline_lib.OfflineSource(cfg.offline_dir)
            offline_lib.check_offline_meta(self.source.meta, plan, cfg.offline_dir)
            self.embed_VD, self.lm_head_DV = (pipeline_lib.replicated(jnp.asarray(a), self.mesh)
                                             for a in self.source.head())

        self.graphdef, params, rest = nnx.split(placed(self._wired_draft(), self.mesh), nnx.Param, ...)
        if self.mesh is not None:   # trainable weights split over the mesh, not replicated (sharding.py)
            params = jax.device_put(params, state_shardings(params, self.mesh, train_param_sharding))
        self.params = nnx.to_pure_dict(params)
        self.rest = nnx.to_pure_dict(rest)
        self.opt_spec = OptimizerSpec.from_config(cfg)
        self.schedule = lr_schedule(cfg)
        with mesh_context(self.mesh):
            self.opt_state = init_optimizer(self.opt_spec, self.params)
        # Committed to explicit shardings, here and after a restore: the same placement means the
        # same compiled step (a restored run must not recompile, nor run a different program).
        self._shardings = jax.tree.map(lambda x: x.sharding, (self.params, self.opt_state))
        self.params, self.opt_state = jax.device_put((self.params, self.opt_state), self._shardings)

        # ---- data, checkpoints, resume
        self.dataset = pipeline_lib.make_dataset(self.source, cfg.batch_size, cfg.seed, rows=self.rows)
        self.data_iter = pipeline_lib.make_iterator(self.dataset, prefetch=2 * cfg.grad_accum)
        self.step = 0
        self.ckpt = ocp.CheckpointManager(
            os.path.abspath(os.path.join(cfg.out_dir, "checkpoints")),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True))
        self._restore_latest()

        self.eval_prompts = None
        self._acc_window: list[dict] = []   # training rows since the last evaluation
        if cfg.eval_every > 0:
            self.eval_prompts = data_lib.read_prompts(cfg.eval_prompts, self.tokenizer)

        leaves, tree = jax.tree.flatten(self._shardings)
        tgraph = self.target.graphdef if self.target else None
        self._step = self.jitted_step(cfg, self.graphdef, tgraph, self.opt_spec, self.aux_ids, tuple(leaves), tree)

    # ------------------------------------------------------------------ what the draft kind decides
    def _wired_draft(self):
        """The new draft checked against the target, with its vocab map (saved once, reused on resume)."""
        V, W, n_aux = self.tcfg.vocab_size, self.dcfg.draft_vocab_size, len(self.aux_ids)
        self.vocab: VocabMap = self._vocab_map(V, W)
        check_pairing(self.dcfg, self.tcfg, n_aux * self.tcfg.hidden_size, n_aux, self.vocab.d2t, None)
        model = self._new_draft()
        model.d2t.value = jnp.asarray(self.vocab.d2t, jnp.int32)
        model.t2d.value = jnp.asarray(self.vocab.t2d, jnp.bool_)
        return model

    def mask_tokenizer(self):
        """The tokenizer that names MASK token candidates: offline runs hold none, so the target directory's."""
        return self.tokenizer if self.tokenizer is not None else data_lib.load_tokenizer(self.cfg.target)

    def _new_draft(self):
        return Draft(self.dcfg, len(self.aux_ids), resolve_dtype(self.cfg.dtype), nnx.Rngs(self.cfg.seed))

    # What the draft kind decides from the settings alone (tools.plan too): its step, the step's args
    # between (params, opt_state, rest) and (tstate, batch, lr), its static settings, and its host's
    # draws for a row (``draw_row(loss mask [T], spec, rng) -> {name: array}``; none: TTT draws nothing).
    train_step = staticmethod(train_step)
    STEP_HEAD = ("embed_VD", "lm_head_DV")
    step_spec = staticmethod(loss_spec)
    draw_row = None

    @functools.cached_property
    def spec(self):
        return self.step_spec(self.cfg)

    @classmethod
    def jitted_step(cls, cfg, graphdef, tgraph, opt_spec, aux_ids, sharding_leaves: tuple, sharding_tree):
        return compiled_step(cls.train_step, graphdef, tgraph, opt_spec, aux_ids, cls.step_spec(cfg), sharding_leaves,
                             sharding_tree)

    @classmethod
    def draws(cls, cfg, loss_mask_ABT, step: int = 0, first_row: int = 0) -> dict:
        return {} if cls.draw_row is None else host_draws(cls.draw_row, cls.step_spec(cfg), loss_mask_ABT, cfg.seed,
                                                          step, first_row)

    # ------------------------------------------------------------------ setup helpers
    def _load_target(self):
        return load_target(self.cfg.target, dtype=self.cfg.resolved_target_dtype, mesh=self.mesh,
                           config=self.plan.target)

    def _vocab_map(self, V: int, W: int) -> VocabMap:
        path = os.path.join(self.cfg.out_dir, "vocab.npz")
        counts = lambda: token_counts(self.source.iter_tokens(), V)  # noqa: E731
        if distributed.is_writer() or os.path.exists(path):
            return load_or_build(path, counts, V, W)  # only process 0 ever writes the file
        # The others build the same map from the same data (or read process 0's file, written atomically).
        return build_vocab_map(counts(), W)

    def next_batch(self) -> dict:   # one optimizer step's rows, with the kind's host draws for each
        rows = [next(self.data_iter) for _ in range(self.cfg.grad_accum)]
        draws = self.draws(self.cfg, np.stack([r["loss_mask"] for r in rows]), self.step, self.rows[0])
        return pipeline_lib.device_batch([{**r, **{k: v[a] for k, v in draws.items()}} for a, r in enumerate(rows)],
                                         self.mesh, self.cfg.batch_size)

    # ------------------------------------------------------------------ checkpoints
    def _save(self):
        import orbax.checkpoint as ocp

        self.ckpt.save(self.step, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(self.params),
            opt_state=ocp.args.StandardSave(self.opt_state),
            data=ocp.args.JsonSave(self.data_iter.get_state()),
            meta=ocp.args.JsonSave({"step": self.step, "config": self.plan.to_dict()})))

    def _restore_latest(self):
        import orbax.checkpoint as ocp

        latest = self.ckpt.latest_step()
        if latest is None:
            if distributed.is_writer() and os.path.exists(self.metrics_path):  # died before its first checkpoint
                os.remove(self.metrics_path)
            return
        meta = self.ckpt.restore(latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        self._check_resumable(meta.get("config", {}), int(meta["step"]))
        restored = self.ckpt.restore(latest, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(self.params),
            opt_state=ocp.args.StandardRestore(self.opt_state),
            data=ocp.args.JsonRestore()))
        self.params, self.opt_state = jax.device_put((restored.params, restored.opt_state), self._shardings)
        self.data_iter.set_state(restored.data)
        self.step = int(meta["step"])
        self._truncate_metrics(self.step)
        log.info("resumed from %s at step %d", self.ckpt.directory, self.step)

    def _check_resumable(self, saved: dict, saved_step: int):
        now = self.plan.to_dict()
        changed = [k for k in RESUME_INVARIANTS if k in saved and saved[k] != now[k]]
        if changed:
            detail = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
            raise SettingsError(
                f"{self.cfg.out_dir} holds checkpoints of a run with different settings ({detail}); "
                "resume with the original settings or use a new out_dir")
        other = [k for k in now if k in saved and saved[k] != now[k] and k not in RESUME_INVARIANTS]
        trained = [k for k in other if k not in OUTPUT_ONLY]
        if trained and saved_step >= self.cfg.total_steps:
            # Nothing would train: the changed settings would silently have no effect.
            detail = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in trained)
            raise SettingsError(
                f"{self.cfg.out_dir} holds a finished run (step {saved_step}) trained with other settings "
                f"({detail}); rerunning it would train nothing. Use a new out_dir for the new settings, or "
                f"raise total_steps above {saved_step} to continue this run with them")
        if other:
            log.warning("resuming with changed settings: %s", ", ".join(other))

    def _truncate_metrics(self, step: int):
        """Drops log lines past the checkpoint, so a resumed run's log reads as one uninterrupted run."""
        if not distributed.is_writer() or not os.path.exists(self.metrics_path):
            return
        with open(self.metrics_path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with atomic_file(self.metrics_path) as f:
            f.writelines(keep)

    def _log(self, record: dict):
        if distributed.is_writer():
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ the draft as a servable object
    def draft_model(self) -> Draft:
        return nnx.merge(self.graphdef, self.params, self.rest)

    def loaded_draft(self) -> LoadedDraft:
        return self.loaded_class(self.draft_model(), self.target, self.aux_ids)

    def evaluate(self) -> dict:
        """Held-out acceptance through the serving loop (K = ``eval_draft_tokens``, greedy), overall and
        per context length, beside SpecForge's estimate from the accuracies since the last one."""
        from eagle3_jax.speculative.engine import Engine, Request
        from eagle3_jax.metrics import GenerationStats

        cfg = self.cfg
        capacity = max(len(p) for p in self.eval_prompts) + cfg.eval_new_tokens + 1
        engine = Engine(self.target, self.loaded_draft(), num_draft_tokens=cfg.eval_draft_tokens, max_len=capacity,
                        batch_size=len(self.eval_prompts), max_new_tokens=cfg.eval_new_tokens,
                        eos_token_ids=self.tokenizer.eos_token_ids if self.tokenizer else ())
        done = list(engine.run([Request(str(i), list(p)) for i, p in enumerate(self.eval_prompts)]))
        stats = GenerationStats.combine(f.stats for f in done)
        record = {"step": self.step, "eval_tau": stats.mean_accept_length,
                  "eval_accept_rate_per_position": stats.accept_rate_per_position,
                  "eval_tau_by_context": tau_by_context((len(self.eval_prompts[int(f.key)]), f.stats) for f in done)}
        if self._acc_window:
            acc_all = np.mean([r["acc_all"] for r in self._acc_window], axis=0)
            record["simulated_acc_len"] = simulated_acc_len(acc_all[:cfg.eval_draft_tokens])
            self._acc_window = []
        return record

    def export(self, path: str | None = None) -> str:
        path = path or self.cfg.resolved_export_dir
        if not distributed.is_multi_process():
            save_draft(self.loaded_draft(), path, dtype=self.cfg.export_dtype)
            return path
        # Every process gathers the full weights (a collective); process 0 writes them.
        params, rest = (jax.tree.map(distributed.fetch, t) for t in (self.params, self.rest))
        if distributed.is_writer():
            save_draft(self.loaded_class(nnx.merge(self.graphdef, params, rest), self.target, self.aux_ids), path,
                       dtype=self.cfg.export_dtype)
        return path

    # ------------------------------------------------------------------ the loop
    def apply_step(self, batch: dict) -> tuple[dict, float]:
        """One optimizer step on ``batch``: (its metrics, on the host; its learning rate)."""
        tstate = self.target.state if self.target is not None else None
        lr = self.schedule(self.step)
        with mesh_context(self.mesh):
            self.params, self.opt_state, m = self._step(self.params, self.opt_state, self.rest,
                                                        *(getattr(self, k) for k in self.STEP_HEAD), tstate, batch,
                                                        jnp.asarray(lr, jnp.float32))
        self.step += 1
        return jax.tree.map(distributed.fetch, m), lr

    def run_step(self, batch: dict) -> dict:
        m, lr = self.apply_step(batch)
        row = {"step": self.step, "loss": float(m["loss"]), "ploss": [float(x) for x in m["ploss"]],
               **{k: [float(x) for x in m[k]] for k in ("acc", "acc_all", "accept")},
               "count": [int(x) for x in m["count"]], "grad_norm": float(m["grad_norm"]), "lr": float(lr)}
        row["simulated_acc_len"] = simulated_acc_len(row["acc_all"])
        self._acc_window.append(row)
        return row

    def train(self, stop_at: int | None = None) -> TrainResult:
        """Runs to ``total_steps`` (or stops after step ``stop_at``, as an interruption would), then exports."""
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        cfg = self.cfg
        end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
        last = None
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc="train",
                   disable=not self.progress or not distributed.is_writer())
        rows_per_step = cfg.batch_size * cfg.grad_accum
        report = StepReport(self.step + 1, end, cfg.total_steps, cfg.log_every, plain=bar.disable)
        if self.step < end:
            _info("training steps %d..%d of %d (%d rows x %d tokens a step)", self.step + 1, end, cfg.total_steps,
                  rows_per_step, cfg.max_len)
        try:
            # log lines print above the bar instead of through it
            with contextlib.nullcontext() if bar.disable else logging_redirect_tqdm():
                while self.step < end:
                    t0 = time.perf_counter()
                    last = self.run_step(self.next_batch())
                    elapsed = time.perf_counter() - t0
                    last["tokens_per_s"] = rows_per_step * cfg.max_len / max(elapsed, 1e-9)
                    self._log(last)
                    bar.update(1)
                    report.step(self.step, elapsed, last)
                    bar.set_postfix(loss=f"{last['loss']:.3f}", acc0=f"{last['acc'][0]:.2f}",
                                    tok_s=f"{last['tokens_per_s']:.0f}")
                    if cfg.eval_every and self.step % cfg.eval_every == 0:
                        ev = self.evaluate()
                        self._log(ev)
                        check_served_acceptance(ev["eval_tau"], ev.get("simulated_acc_len"), cfg.eval_draft_tokens,
                                                cfg.eval_min_accept_share, where=f"step {self.step} eval")
                        if distributed.is_writer():
                            sim = ev.get("simulated_acc_len")
                            bar.write(f"step {self.step}: eval tau {ev['eval_tau']:.3f}" + (
                                "" if sim is None else f" (offline estimate 1 + {sim:.3f})"), file=sys.stderr)
                    if self.step % cfg.save_every == 0 or self.step == cfg.total_steps:
                        self._save()
        finally:
            bar.close()
            self.ckpt.wait_until_finished()
        finished = self.step >= cfg.total_steps
        export_dir = None
        if finished:
            export_dir = cfg.resolved_export_dir
            if os.path.exists(export_dir):
                log.info("%s already exists (a finished run); not overwritten", export_dir)
            else:
                t0 = time.perf_counter()
                self.export(export_dir)
                _info("exported the draft to %s in %.1fs", export_dir, time.perf_counter() - t0)
        return TrainResult(step=self.step, finished=finished, export_dir=export_dir, last_metrics=last)

    def close(self):
        self.ckpt.wait_until_finished()
        self.ckpt.close()
