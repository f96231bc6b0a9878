"""``DraftKind``: everything that differs between kinds of draft, as one record a kind (looked up
in the registry, ``eagle3_jax.drafts``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class DraftKind:
    # ---- identity
    name: str                        # a train config's ``draft_kind``
    title: str                       # its name in messages ("EAGLE-3")
    architectures: tuple[str, ...]   # config.json ``architectures`` it answers to; the first is written
    config: type                     # its config class: ``from_hf_dict(d, where)``, ``to_hf_dict()``
    module: type                     # its NNX module: ``module(cfg, n_aux, dtype, rngs)``

    # ---- checkpoints
    load: Callable[..., Any]         # (path, cfg, target, dtype) -> LoadedDraft; cfg read, the pair preflighted
    build: Callable[..., Any]        # (cfg, target, dtype, seed) -> LoadedDraft with random weights
    save: Callable[..., None]        # (draft, path, out_dtype, dtype_name, config_overrides)
    # tools.convert: (path, reader, cfg) -> the JSON-able facts of the stored tensors the name table
    # needs; (cfg, wiring, dtype) -> (rules, our path -> abstract variable of each converted tensor)
    wiring: Callable[..., dict]
    convert_table: Callable[..., tuple[list, dict]]

    # ---- the decode loop (inside the jitted round; signatures in docs/architecture.md, "Adding a kind")
    propose: Callable[..., tuple]    # -> (ids_BK, q_BKW, dcache): the round's K guesses
    catch_up: Callable[..., Any]     # -> DraftStep: the verified positions re-read with the true aux states

    # ---- training
    trainer: str                     # "module:Class" of its training loop in eagle3_jax.train
    train_config: Callable[..., Any]  # (d: config.json dict, run settings, from_file, where) -> config
    settings_key: str | None = None   # the TrainConfig key of this kind's own settings (None: none)
    # (run settings, target config, draft file dict | None) -> raises on a setting the kind cannot use
    check_train: Callable[..., None] = lambda cfg, tcfg, file: None
    # (draft file dict | None, run settings, target config) -> the aux layer ids a run trains with
    # when its ``aux_layer_ids`` is unset
    train_aux_ids: Callable[..., tuple] = lambda file, cfg, tcfg: eagle_file_aux_ids(file, tcfg)

    # ---- preflight: observations that do not stop a run, (cfg, where) -> [str]
    notes: Callable[..., list] = lambda cfg, where: []

    # ---- whether a round's first guess comes from the draft's output at the anchor, kept in the loop
    # state (dhidden_BD, dlogits_BW); False: the pass starts from the newest token itself
    seeded: bool = True


def eagle_file_aux_ids(file: dict | None, tcfg) -> tuple[int, ...]:
    """The EAGLE-3 layout's rule: the draft file's ``eagle_config`` ids, else the target's default."""
    ids = ((file or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tcfg.default_aux_layer_ids() if ids is None else tuple(int(i) for i in ids)


def catch_up_by_rereading(draft, ids_BT, aux_BTX, positions_BT, embed_VD, dcache):
    """The catch-up of drafts whose known positions go through their ordinary call (the chain draft
    and P-EAGLE): one pass over the verified positions, writing their keys over the guesses'."""
    return draft(ids_BT, draft.fuse(aux_BTX), positions_BT, embed_VD, dcache, with_logits=False)
