"""``DraftKind``: everything that differs between kinds of draft, as one record a kind.

The decode loop, the loaders, the converter, the doctor, the planner and the trainer never ask
which kind a draft is: they look its ``DraftKind`` up in the registry (``eagle3_jax.drafts``) by
architecture, config, module or name, and call what it holds.
"""

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

    # ---- checkpoints: (path, cfg, target, dtype) with cfg already read and the pair preflighted
    load: Callable[..., Any]         # -> LoadedDraft
    build: Callable[..., Any]        # (cfg, target, dtype, seed) -> LoadedDraft with random weights
    save: Callable[..., None]        # (draft, path, out_dtype, dtype_name, config_overrides)
    # tools.convert: the facts of the stored tensors its name table needs (JSON-able), read from
    # headers: (path, reader, cfg) -> wiring; and (cfg, wiring, dtype) -> (rules, our path -> abstract
    # variable) of exactly the tensors the table converts
    wiring: Callable[..., dict]
    convert_table: Callable[..., tuple[list, dict]]

    # ---- the decode loop (inside the jitted round)
    # (draft, dlogits_BW, dhidden_BD, dcache, lengths_B, keys, pick, embed_VD, last_B, head) -> (ids_BK
    # in the draft vocab, q_BKW, dcache): the round's K guesses; ``pick(key, logits_BW) -> (ids_B,
    # q_BW)``; ``last_B`` the newest token (at position lengths_B), ``head`` the target's logits of
    # hidden states (for a draft that reads the target's head)
    propose: Callable[..., tuple]
    # (draft, ids_BT, aux_BTX, positions_BT, embed_VD, dcache) -> DraftStep (hidden states, no
    # logits): the draft re-reads the verified positions with the target's true aux states
    catch_up: Callable[..., Any]

    # ---- training
    trainer: str                     # "module:Class" of its training loop in eagle3_jax.train
    train_config: Callable[..., Any]  # (d: config.json dict, run settings, from_file, where) -> config
    check_train: Callable[..., None]  # (run settings, target config, draft file dict | None) -> raises
    settings_key: str | None = None   # the TrainConfig key of this kind's own settings (None: none)
    # (draft file dict | None, run settings, target config) -> the aux layer ids a run trains with
    # when its ``aux_layer_ids`` is unset
    train_aux_ids: Callable[..., tuple] = lambda file, cfg, tcfg: eagle_file_aux_ids(file, tcfg)

    # ---- preflight: observations that do not stop a run, (cfg, where) -> [str]
    notes: Callable[..., list] = lambda cfg, where: []

    # ---- the decode loop again: whether a round's first guess comes from the draft's own output at
    # the anchor, which prefill and catch-up keep in the loop state (dhidden_BD, dlogits_BW). False:
    # the kind keeps none (its pass starts from the newest token itself) and its catch-up's hidden
    # states are not read
    seeded: bool = True


def eagle_file_aux_ids(file: dict | None, tcfg) -> tuple[int, ...]:
    """The EAGLE-3 layout's rule: the draft file's ``eagle_config`` ids, else the target's default."""
    ids = ((file or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tcfg.default_aux_layer_ids() if ids is None else tuple(int(i) for i in ids)


def catch_up_by_rereading(draft, ids_BT, aux_BTX, positions_BT, embed_VD, dcache):
    """The catch-up of drafts whose known positions go through their ordinary call (the chain draft
    and P-EAGLE): one pass over the verified positions, writing their keys over the guesses'."""
    return draft(ids_BT, draft.fuse(aux_BTX), positions_BT, embed_VD, dcache, with_logits=False)
