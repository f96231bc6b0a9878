"""Static checks of a target/draft pair, from config.json files and safetensors headers only.

``check_pair`` is the door every entry point goes through first (serve.py, train.py, ``load_draft``,
``tools.doctor``): on a terabyte target, a wrong fc width must be reported in seconds, not after a
full load. Failures raise with both numbers and the fix; observations that do not stop a run are
returned as ``PairFacts.notes``. (The range of ``d2t``, which needs data, is checked in ``load_draft``.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from eagle3_jax import drafts
from eagle3_jax.checkpoint.quant import FLOAT_CODES
from eagle3_jax.config import DTYPES, MeshConfig, TargetConfig
from eagle3_jax.drafts import DraftConfig
from eagle3_jax.contracts import check_pairing, resolve_aux_ids
from eagle3_jax.errors import CheckpointError, ConfigError

# Probe text for tokenizer agreement: prose, code, digits and non-ASCII, where vocabularies differ.
TOKENIZER_PROBE = "The quick brown fox jumps over 13 lazy dogs.\ndef f(x):\n    return x ** 2  # größer, 東京"


@dataclass
class TensorHeader:
    shape: tuple[int, ...]
    dtype: str     # safetensors code (F32, BF16, I64, BOOL, ...) or a numpy dtype name


@dataclass
class PairFacts:
    """What the static checks found; the doctor prints it."""

    target: TargetConfig
    draft: DraftConfig | None = None
    aux_layer_ids: tuple[int, ...] = ()
    fc_in_width: int | None = None
    target_dtype: str | None = None      # torch_dtype in the target's config.json
    draft_dtype: str | None = None       # torch_dtype in the draft's config.json
    quantization: str | None = None      # the target's quantization method, None for plain weights
    notes: list[str] = field(default_factory=list)

    @property
    def num_aux_layers(self) -> int:
        """How many target layers the draft's fc fuses (from fc.weight's width when known)."""
        H = self.target.hidden_size
        if self.fc_in_width is not None and self.fc_in_width % H == 0:
            return self.fc_in_width // H
        return len(self.aux_layer_ids)


def check_pair(target, draft=None, *, mesh=None, dtype=None, max_len: int | None = None,
               weights: str | None = None, target_config: TargetConfig | None = None) -> PairFacts:
    """Checks everything that needs no weights; raises on the first failure. ``target``: a checkpoint
    directory or a TargetConfig. ``draft``: a draft directory, a config (a draft about to be trained)
    or None. ``mesh``: a spec string, ``"auto"``/``"none"``, a MeshConfig, a jax Mesh or None.
    ``weights="native"`` refuses a quantization_config whose weights cannot be held as stored.
    ``target_config``: the config already read from the ``target`` directory."""
    from eagle3_jax.checkpoint.quant import QuantScheme

    target_dir = None
    if isinstance(target, TargetConfig):
        tcfg = target
    else:
        target_dir = os.fspath(target)
        tcfg = target_config if target_config is not None else TargetConfig.from_path(target_dir)
    facts = PairFacts(target=tcfg, target_dtype=torch_dtype(tcfg.hf_config))
    facts.quantization = QuantScheme.from_hf_config(tcfg.hf_config, _where(target_dir)).method
    if weights == "native":
        from eagle3_jax.checkpoint.quant_native import check_native_config

        check_native_config(tcfg.hf_config, _where(target_dir))
    _check_dtype(dtype)
    _check_mesh(mesh)
    if target_dir is not None:
        _check_target_headers(target_dir, tcfg)
    if max_len is not None and max_len > tcfg.max_position_embeddings:
        facts.notes.append(f"max_len {max_len} exceeds the target's max_position_embeddings "
                           f"{tcfg.max_position_embeddings}; positions past it were never trained")
    if draft is None:
        return facts

    draft_dir, dcfg = None, draft   # a config of any kind: a draft about to be trained
    if isinstance(draft, (str, os.PathLike)):
        draft_dir = os.fspath(draft)
        dcfg = drafts.read_config(draft_dir)   # the kind its architecture names
    facts.draft, facts.draft_dtype = dcfg, torch_dtype(dcfg.hf_config)
    if dcfg.hf_config.get("quantization_config"):
        raise ConfigError(
            f"{draft_dir or 'draft'}: config.json has a quantization_config "
            f"({dcfg.hf_config['quantization_config'].get('quant_method')!r}), but drafts are loaded in "
            "bf16/fp16/fp32 only; export the draft unquantized")
    facts.aux_layer_ids = resolve_aux_ids(dcfg, tcfg)
    tensors = _draft_headers(draft_dir) if draft_dir is not None else None
    if tensors is None:   # a draft about to be built: its fc is made to fit its ids
        fc_in, embed_width = len(facts.aux_layer_ids) * dcfg.target_hidden_size, None
    else:
        embed = tensors.get("embed_tokens.weight")
        fc_in, embed_width = tensors["fc.weight"].shape[1], None if embed is None else embed.shape[1]
    facts.fc_in_width = fc_in
    check_pairing(dcfg, tcfg, fc_in, len(facts.aux_layer_ids), None, embed_width)
    if tensors is not None:
        _check_draft_tensors(tensors, dcfg, draft_dir)
    facts.notes += drafts.of_config(dcfg).notes(dcfg, _where(draft_dir))
    if getattr(dcfg, "mla", None) is None and dcfg.head_dim % 2:   # MLA's rope width is checked with its config
        raise ConfigError(f"{_where(draft_dir)}: draft head_dim={dcfg.head_dim} is odd, but rotary embeddings "
                          "rotate pairs of dimensions; use an even head_dim")
    if max_len is not None and max_len > dcfg.max_position_embeddings:
        facts.notes.append(f"max_len {max_len} exceeds the draft's max_position_embeddings "
                           f"{dcfg.max_position_embeddings}: acceptance may fall on long rows")
    if facts.target_dtype and facts.draft_dtype and facts.target_dtype != facts.draft_dtype:
        facts.notes.append(f"target torch_dtype {facts.target_dtype}, draft torch_dtype {facts.draft_dtype}: "
                           "the draft computes in the target's dtype")
    if target_dir is not None and draft_dir is not None:
        _check_tokenizers(target_dir, draft_dir)
    return facts


# ---------------------------------------------------------------------- the pieces
def _where(path) -> str:
    return os.path.join(path, "config.json") if path else "config.json"


def torch_dtype(hf: dict, supported=None) -> str | None:
    """The config's torch_dtype (its text model's first, for Kimi-K2.5); with ``supported``, the first one in it."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    names = (d.get("torch_dtype") or d.get("dtype") for d in (text, hf))
    return next((n for n in names if n and (supported is None or n in supported)), None)


def _check_dtype(dtype) -> None:
    if dtype is None or dtype == "auto" or not isinstance(dtype, str):
        return
    if dtype not in DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not supported; use one of {sorted(DTYPES)} or 'auto'")


def _check_mesh(mesh) -> None:
    """A mesh asking for more devices than exist fails here, not after the target has loaded."""
    if mesh is None or (isinstance(mesh, str) and mesh in ("auto", "none")):
        return
    if not isinstance(mesh, (str, dict, MeshConfig)):   # a built jax Mesh already fits its devices
        return
    import jax

    want, have = MeshConfig.parse(mesh), jax.device_count()
    if want.size > have:
        raise ConfigError(
            f"mesh data={want.data},expert={want.expert},tensor={want.tensor} needs {want.size} devices but "
            f"{have} are visible ({jax.default_backend()}). Use a mesh whose sizes multiply to at most {have}, "
            "no mesh (--mesh none / mesh=None: one device), or, on CPU, fake devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={want.size}")


def _check_target_headers(path: str, tcfg: TargetConfig) -> None:
    """The embedding table's shape against config.json (a wrong config.json next to the weights)."""
    from eagle3_jax.checkpoint import store
    from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader

    if store.is_jax_checkpoint(path):
        return
    reader = CheckpointReader(path)
    key = tcfg.weight_prefix + "model.embed_tokens.weight"
    if key in reader:
        found = tuple(reader.shape(key))
        if found != (tcfg.vocab_size, tcfg.hidden_size):
            raise CheckpointError(
                f"{path}: {key} has shape {list(found)} but config.json says vocab_size x hidden_size = "
                f"[{tcfg.vocab_size}, {tcfg.hidden_size}]; the config.json belongs to another checkpoint")


def _draft_headers(path: str) -> dict[str, TensorHeader]:
    """Names -> shape and dtype, from safetensors headers (or a converted checkpoint's metadata)."""
    from eagle3_jax.checkpoint import store
    from eagle3_jax.checkpoint.checkpoint_reader import CheckpointReader

    if store.is_jax_checkpoint(path):
        stored = store.read_meta(path)["params"]
        out = {}
        # (our name, HF name, stored [in, out] where the HF layout has [out, in])
        for ours, hf, transposed in (("fc", "fc.weight", True), ("lm_head", "lm_head.weight", True),
                                     ("embed_tokens", "embed_tokens.weight", False), ("d2t", "d2t", False),
                                     ("t2d", "t2d", False)):
            if ours in stored:
                shape = tuple(stored[ours]["shape"])
                out[hf] = TensorHeader(shape[::-1] if transposed else shape, str(stored[ours].get("dtype")))
    else:
        reader = CheckpointReader(path)
        out = {k: TensorHeader(tuple(reader.shape(k)), reader.dtype_code(k)) for k in reader.keys()}
    if "fc.weight" not in out:
        raise CheckpointError(
            f"{path}: no fc.weight: this is not an EAGLE-3 draft (EAGLE-3 fuses the target's aux states with fc). "
            "An EAGLE-1/2 draft cannot be served as EAGLE-3")
    return out


def _check_draft_tensors(tensors: dict[str, TensorHeader], dcfg: DraftConfig, path: str) -> None:
    D, W, V = dcfg.hidden_size, dcfg.draft_vocab_size, dcfg.vocab_size
    fc_out = tensors["fc.weight"].shape[0]
    if fc_out != D:
        raise CheckpointError(f"{path}: fc.weight produces {fc_out} features but the draft's hidden_size is {D}; "
                              "config.json and the weights disagree")
    lm = tensors.get("lm_head.weight")
    if lm is not None and lm.shape[0] != W:
        raise CheckpointError(
            f"{path}: lm_head.weight has {lm.shape[0]} rows but draft_vocab_size is {W}; set draft_vocab_size to "
            f"{lm.shape[0]} in config.json (or re-export the draft)")
    d2t = tensors.get("d2t")
    if d2t is not None and d2t.shape != (W,):
        raise CheckpointError(f"{path}: d2t has shape {list(d2t.shape)} but draft_vocab_size is {W}; "
                              "the vocab map belongs to another draft")
    t2d = tensors.get("t2d")
    if t2d is not None and t2d.shape != (V,):
        raise CheckpointError(f"{path}: t2d has shape {list(t2d.shape)} but the target vocab is {V}; "
                              "the vocab map belongs to another tokenizer")
    if "d2t" not in tensors and W != V:
        raise CheckpointError(
            f"{path}: draft_vocab_size={W} < vocab_size={V} but the checkpoint has no d2t tensor mapping draft "
            "ids to target ids; re-export the draft with its vocab map")
    for name, h in tensors.items():
        if name.endswith(".weight") and h.dtype.upper() not in FLOAT_CODES and h.dtype not in DTYPES:
            raise CheckpointError(f"{path}: {name} is stored as {h.dtype}; draft weights must be one of "
                                  f"{', '.join(FLOAT_CODES)} (drafts are not loaded quantized)")


def _check_tokenizers(target_dir: str, draft_dir: str) -> None:
    """Where both sides ship a tokenizer, they must be the same one."""
    from eagle3_jax.tokenizer import TokenizerError, load_tokenizer

    def ships(d):
        return any(os.path.isfile(os.path.join(d, f)) for f in ("tokenizer.json", "tiktoken.model"))

    if not (ships(target_dir) and ships(draft_dir)):
        return
    t_tok, d_tok = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    if t_tok.vocab_size != d_tok.vocab_size:
        raise TokenizerError(
            f"the target's tokenizer has {t_tok.vocab_size} tokens, the draft's ({draft_dir}) {d_tok.vocab_size}; "
            "the draft was trained with another tokenizer: use a draft trained for this target")
    t_ids, d_ids = t_tok.encode(TOKENIZER_PROBE), d_tok.encode(TOKENIZER_PROBE)
    if t_ids != d_ids:
        first = next((i for i, (a, b) in enumerate(zip(t_ids, d_ids)) if a != b), min(len(t_ids), len(d_ids)))
        raise TokenizerError(
            f"the target's and the draft's ({draft_dir}) tokenizers have the same size but split the same text "
            f"differently (first difference at token {first}: {t_ids[first:first + 3]} vs {d_ids[first:first + 3]}); "
            "the draft was trained with another tokenizer: use a draft trained for this target")
