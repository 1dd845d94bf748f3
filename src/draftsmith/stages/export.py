"""Engine layouts of an EAGLE-3 drafter (SGLang, vLLM, speculators) and import back into draftsmith's own.

Every engine loads the same tensors under slightly different names and configs, and each mismatch fails
silently: SGLang skips unknown weight names, vLLM reads aux layer ids literally while SGLang adds one, the
speculators path assumes ``norm_before_residual = True`` when the field is absent. This module writes each
layout exactly as the engine's loader reads it and reads any of them (plus the SafeAILab reference and
SpecForge checkpoints) back into one canonical form, so ``import(export(x))`` is ``x``.

Aux layer id conventions (field notes section 2):
  * draftsmith, vLLM, speculators: ``L`` = the residual stream entering target layer ``L``
    (top-level ``eagle_aux_hidden_state_layer_ids``; vLLM's runner reads it first and literally).
  * SGLang / SpecForge: ``eagle_config.eagle_aux_hidden_state_layer_ids`` = output of layer ``i``; SGLang's
    loader adds one, so the same layers are listed one lower.

Facts taken from vLLM 0.32's source (``model_executor/models/llama_eagle3.py``, ``v1/worker/gpu_model_runner.py``,
``transformers_utils/configs/speculators/algos.py``):
  * ``Eagle3LlamaForCausalLM.load_weights`` skips ``t2d``, renames ``d2t`` to ``draft_id_to_target_id`` (a
    parameter that exists only when ``draft_vocab_size != vocab_size``: a ``d2t`` on a full vocabulary is an
    error there), prefixes everything but ``lm_head`` with ``model.``, maps ``midlayer.`` to ``layers.0.``, and
    silently ignores unexpected ``*.bias`` tensors.
  * ``LlamaModel`` counts aux states from ``num_aux_hidden_states`` or ``eagle_config`` (else 3), never from the
    top-level ids: a drafter with another count must say ``num_aux_hidden_states``.
  * When the top-level ids are absent, the v1 runner takes ``eagle_config``'s ids literally (no +1): an SGLang
    config without the top-level field is read one layer low by vLLM. The SGLang export therefore carries both.
  * speculators: ``transformer_layer_config`` is the base dict; ``draft_vocab_size``, ``target_hidden_size``,
    ``norm_before_residual`` (default True!), ``eagle_aux_hidden_state_layer_ids`` are copied from the top level,
    and the architecture becomes ``Eagle3LlamaForCausalLM`` for ``model_type`` llama.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith import __version__
from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import (
    MIDLAYER_PREFIX,
    REQUIRED_WEIGHTS,
    ConventionError,
    canonical_weight_name,
    from_sglang_layer_ids,
    is_drafter_weight,
    reference_weight_name,
    speculative_config,
    to_sglang_layer_ids,
)
from draftsmith.core.io import atomic_write
from draftsmith.model.drafter import WEIGHTS_FILE, DrafterConfig, Eagle3Drafter

EXPORT_FORMATS = ("sglang", "vllm", "speculators")
IMPORT_FORMATS = ("eagle", "sglang", "vllm", "speculators", "draftsmith")
MANIFEST_FILE = "draftsmith-export.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_ARCHITECTURE = "Eagle3LlamaForCausalLM"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
# Architectures vLLM 0.32's registry maps onto llama_eagle3.Eagle3LlamaForCausalLM (parallel-drafting PEagle
# variants excluded: they need a mask_hidden tensor draftsmith's drafter has no use for), plus the plain Llama
# name EAGLEConfig prefixes with "Eagle3".
LLAMA_EAGLE3_ARCHITECTURES = {
    SGLANG_ARCHITECTURE, VLLM_ARCHITECTURE, SPECULATORS_ARCHITECTURE, "LlamaForCausalLM",
    "Eagle3MiniMaxM2ForCausalLM", "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM",
}
# Config switches of EAGLE-3 variants whose computation draftsmith's drafter does not implement.
_UNSUPPORTED_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias", "bias")



class ExportError(ConventionError):
    """A drafter that cannot be written in (or read from) a layout without losing something."""


# --- the canonical in-memory checkpoint -----------------------------------------------------------------
@dataclass
class DrafterCheckpoint:
    """A drafter as plain data: config plus tensors under draftsmith's names (``layers.0.*``, ``d2t``, ``t2d``).

    ``aux_known`` is False for checkpoints that never said which target layers they read (the reference
    EAGLE-3 releases): engines then use the target's default (2, N//2, N-3), and so does ``load_drafter``.
    """

    config: DrafterConfig
    state: dict[str, torch.Tensor]
    aux_known: bool = True
    source: str = "<in memory>"
    source_format: str = "draftsmith"
    warnings: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.state["fc.weight"].dtype

    @property
    def has_own_embedding(self) -> bool:
        return "embed_tokens.weight" in self.state

    @property
    def n_aux(self) -> int:
        return self.state["fc.weight"].shape[1] // self.config.target_hidden_size

    @classmethod
    def from_drafter(cls, drafter: Eagle3Drafter) -> DrafterCheckpoint:
        state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
        return cls(config=dataclasses.replace(drafter.config), state=state)

    def build(self) -> Eagle3Drafter:
        """An ``Eagle3Drafter`` holding exactly these tensors (strict load: every shape is checked)."""
        cfg = self.config
        if not self.aux_known:  # fc's width needs a count; the ids themselves stay unknown
            cfg = dataclasses.replace(cfg, aux_layer_ids=tuple(range(self.n_aux)))
        dv = vocab_mod.DraftVocab(d2t=self.state["d2t"], t2d=self.state["t2d"])
        drafter = Eagle3Drafter(cfg, draft_vocab=dv, own_embedding=self.has_own_embedding).to(self.dtype)
        try:
            drafter.load_state_dict(self.state, strict=True)
        except RuntimeError as e:
            raise ExportError(f"{self.source}: tensors do not fit the config: {' '.join(str(e).split())}") from e
        return drafter.eval()


# --- export ---------------------------------------------------------------------------------------------
@dataclass
class ExportReport:
    format: str
    path: Path
    weights: list[str]
    dtype: str
    aux_layer_ids: list[int]  # draftsmith / vLLM convention
    aux_layer_ids_sglang: list[int] | None
    num_speculative_tokens: int
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ids = self.aux_layer_ids or "unknown (the engine uses the target's default)"
        lines = [f"exported {self.format} drafter to {self.path} ({len(self.weights)} tensors, {self.dtype})",
                 f"aux layer ids: {ids} (input of layer L; vLLM)"
                 + (f", {self.aux_layer_ids_sglang} in SGLang's eagle_config" if self.aux_layer_ids_sglang
                    is not None else "")]
        k = self.num_speculative_tokens
        if self.format == "sglang":
            lines.append(f"serve: python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {self.path} --speculative-num-steps {k} "
                         f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
        elif self.format == "vllm":
            spec = json.dumps(speculative_config(self.path, k))
            lines.append(f"serve: vllm serve TARGET --speculative-config '{spec}'")
        else:
            lines.append(f"serve: vllm serve {self.path}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}


def export_drafter(
    drafter: Eagle3Drafter | DrafterCheckpoint | str | Path,
    out: str | Path,
    fmt: str,
    *,
    dtype: str = "bf16",
    include_embeddings: bool = False,
    embeddings: torch.Tensor | None = None,
    verifier: str | None = None,
    verifier_architectures: list[str] | None = None,
    num_speculative_tokens: int = 3,
    overwrite: bool = False,
) -> ExportReport:
    """Write ``drafter`` (an object, or a directory in any importable layout) in an engine's layout.

    ``embeddings`` is the target's input embedding table, needed only for ``include_embeddings`` when the
    drafter shares the target's (engines otherwise share it themselves). A drafter with its own embedding
    (another width than the target's) always carries it: engines could not share the target's.
    """
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if num_speculative_tokens < 1:
        raise ExportError("num_speculative_tokens must be >= 1")
    if isinstance(drafter, Eagle3Drafter):  # a live drafter is consistent by construction
        ckpt = DrafterCheckpoint.from_drafter(drafter)
    else:
        ckpt = drafter if isinstance(drafter, DrafterCheckpoint) else read_checkpoint(drafter)
        ckpt.build()  # validate shapes and d2t/t2d before writing anything
    cfg = ckpt.config
    out = Path(out)
    if isinstance(drafter, (str, Path)) and out.resolve() == Path(drafter).resolve():
        raise ExportError(f"{out}: the export would overwrite its own source")
    notes = list(ckpt.warnings)
    if fmt == "speculators" and not verifier:
        raise ExportError("the speculators layout names its verifier (vLLM serves that model): pass verifier= "
                          "(--verifier NAME_OR_PATH), the target's Hugging Face id or directory")
    if not ckpt.aux_known:
        notes.append("aux layer ids unknown (source did not record them): the engine will use the target's "
                     "default (2, N//2, N-3)")

    state = dict(ckpt.state)
    if include_embeddings and not ckpt.has_own_embedding:
        if embeddings is None:
            raise ExportError("include_embeddings needs the target's embedding table (--target DIR)")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(f"target embedding has shape {tuple(embeddings.shape)}, the drafter needs "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
        state["embed_tokens.weight"] = embeddings.detach().cpu()
    embedded = "embed_tokens.weight" in state

    if fmt == "sglang":
        if ckpt.n_aux != 3:
            notes.append(f"{ckpt.n_aux} aux layers: SGLang's llama_eagle3 has sized fc for 3; check your version")
        if cfg.norm_before_residual:
            notes.append("norm_before_residual=True: check that your SGLang version implements it")
        if ckpt.has_own_embedding:
            notes.append("the drafter's width differs from the target's: SGLang versions that hand EAGLE-3 "
                         "drafters the target's embedding cannot serve it; check yours")
        config = _sglang_config(ckpt)
        state = {reference_weight_name(k): v for k, v in state.items()}
        if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping: vLLM refuses a d2t on a full vocabulary
            state.pop("d2t")
            state.pop("t2d")
    else:
        # vLLM skips t2d, and its d2t parameter exists only for a reduced vocabulary.
        state.pop("t2d")
        if cfg.draft_vocab_size == cfg.vocab_size:
            state.pop("d2t")
        if fmt == "vllm":
            config = _vllm_config(ckpt)
        else:
            config = _speculators_config(ckpt, verifier, verifier_architectures, num_speculative_tokens)

    target_dtype = DTYPES[dtype]
    state = {k: _convert(k, v, target_dtype) for k, v in state.items()}
    _set_dtype(config, target_dtype, fmt)
    manifest = {
        "format": fmt,
        "draftsmith_version": __version__,
        "source": ckpt.source,
        "source_format": ckpt.source_format,
        "aux_layer_ids": list(cfg.aux_layer_ids) if ckpt.aux_known else None,
        "aux_layer_ids_convention": "input of layer L (vLLM, speculators, draftsmith)",
        "aux_layer_ids_sglang": to_sglang_layer_ids(cfg.aux_layer_ids) if ckpt.aux_known and min(cfg.aux_layer_ids) > 0
        else None,
        "aux_layer_ids_sglang_convention": "output of layer i (SGLang eagle_config; its loader adds 1)",
        "dtype": {"from": _dtype_name(ckpt.dtype), "to": _dtype_name(target_dtype)},
        "embed_tokens": embedded,
        "num_speculative_tokens": num_speculative_tokens,
        "target": cfg.target,
        "weights": sorted(state),
    }
    _write(out, config, state, manifest, overwrite)
    for n in notes:
        warnings.warn(n, stacklevel=2)
    return ExportReport(
        format=fmt, path=out, weights=sorted(state), dtype=_dtype_name(target_dtype),
        aux_layer_ids=manifest["aux_layer_ids"] or [], aux_layer_ids_sglang=manifest["aux_layer_ids_sglang"]
        if fmt == "sglang" else None, num_speculative_tokens=num_speculative_tokens, warnings=notes,
    )


def _llama_fields(cfg: DrafterConfig, n_aux: int) -> dict:
    """The Llama config fields all three layouts share (one decoder layer, no biases, untied head)."""
    return {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "num_aux_hidden_states": n_aux,
    }


def _sglang_config(ckpt: DrafterCheckpoint) -> dict:
    cfg = ckpt.config
    d = {"architectures": [SGLANG_ARCHITECTURE], **_llama_fields(cfg, ckpt.n_aux),
         "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
         "norm_before_residual": cfg.norm_before_residual}
    if ckpt.aux_known:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": to_sglang_layer_ids(cfg.aux_layer_ids),
                             "use_aux_hidden_state": True}
        # SGLang reads only eagle_config; vLLM reads this top-level field first and literally, and would
        # otherwise take eagle_config's ids one layer low. Both describe the same layers.
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def _vllm_config(ckpt: DrafterCheckpoint) -> dict:
    cfg = ckpt.config
    d = {"architectures": [VLLM_ARCHITECTURE], **_llama_fields(cfg, ckpt.n_aux),
         "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
         "norm_before_residual": cfg.norm_before_residual}
    if ckpt.aux_known:
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def _speculators_config(ckpt: DrafterCheckpoint, verifier: str, verifier_architectures: list[str] | None,
                        k: int) -> dict:
    cfg = ckpt.config
    archs = verifier_architectures
    if archs is None:
        archs = _verifier_architectures(verifier) or (
            [cfg.target["architecture"]] if cfg.target.get("architecture") else [])
    d = {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_fields(cfg, ckpt.n_aux),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM defaults this to True when absent; draftsmith's default is False: always explicit.
        "norm_before_residual": cfg.norm_before_residual,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(archs)},
        },
    }
    if ckpt.aux_known:
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def _verifier_architectures(verifier: str) -> list[str] | None:
    cfg = Path(verifier) / "config.json"
    if cfg.is_file():
        try:
            return list(json.loads(cfg.read_text()).get("architectures") or []) or None
        except (OSError, json.JSONDecodeError):
            return None
    return None


def _convert(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floats to the export dtype (d2t stays int64, t2d bool); a value the dtype cannot hold is an error."""
    if name == "d2t":
        return t.to(torch.int64).contiguous()
    if name == "t2d":
        return t.to(torch.bool).contiguous()
    out = t.to(dtype).contiguous()
    if not torch.isfinite(out).all():
        raise ExportError(f"{name}: values overflow {_dtype_name(dtype)} (max |x| = {t.abs().max().item():.4g}); "
                          "export in bf16 or fp32")
    return out


def _set_dtype(config: dict, dtype: torch.dtype, fmt: str) -> None:
    """SGLang deployments run transformers 4.x, which reads ``torch_dtype``; vLLM 0.32 runs 5.x, where that
    key is deprecated (its speculators config path warns) in favour of ``dtype``."""
    name = _dtype_name(dtype)
    config["torch_dtype" if fmt == "sglang" else "dtype"] = name
    if fmt == "speculators":
        config["transformer_layer_config"]["dtype"] = name


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write(out: Path, config: dict, state: dict[str, torch.Tensor], manifest: dict, overwrite: bool) -> None:
    """Write config, weights and manifest, each atomically; refuse to mix with another checkpoint's files."""
    from safetensors.torch import save as st_save

    out.mkdir(parents=True, exist_ok=True)
    ours = {"config.json", WEIGHTS_FILE, MANIFEST_FILE}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and (
        p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json")))
    if foreign:
        raise ExportError(f"{out}: holds other weight files {foreign}; an engine could load those instead. "
                          "Use an empty directory")
    if not overwrite and any((out / n).exists() for n in ours):
        raise ExportError(f"{out}: already holds a checkpoint; pass overwrite=True (--force) to replace it")
    atomic_write(out / WEIGHTS_FILE, st_save(state, metadata={"format": "pt"}))
    atomic_write(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    atomic_write(out / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())


def target_embeddings(target: str | Path, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The target's input embedding table, read from its safetensors without loading the model."""
    from draftsmith.model.target import load_target_heads

    return load_target_heads(target, dtype=dtype or torch.float32).embed_tokens.weight.detach()


# --- import ---------------------------------------------------------------------------------------------
@dataclass
class ImportReport:
    format: str
    source: Path
    path: Path
    aux_layer_ids: list[int] | None  # draftsmith convention; None = the target's default at load time
    dropped: list[str]
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else "unknown (target default at load)"
        lines = [f"imported {self.format} drafter {self.source} -> {self.path}",
                 f"aux layer ids: {ids} (input of layer L)"]
        if self.dropped:
            lines.append(f"dropped: {', '.join(self.dropped)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "source": str(self.source), "path": str(self.path)}


def import_drafter(src: str | Path, out: str | Path, fmt: str = "auto", *, aux_layers=None,
                   overwrite: bool = False) -> ImportReport:
    """Convert an EAGLE-3 checkpoint (reference, SpecForge, SGLang, vLLM, speculators) into draftsmith's layout."""
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise ExportError(f"{out}: the import would overwrite its own source")
    dropped: list[str] = []
    ckpt = read_checkpoint(src, fmt, aux_layers=aux_layers, dropped=dropped)
    drafter = ckpt.build()
    _check_out(out, overwrite)
    drafter.save(out)
    if not ckpt.aux_known:  # save() wrote the placeholder ids build() needed; record "unknown" instead
        cfg_file = out / "config.json"
        d = json.loads(cfg_file.read_text())
        d["eagle_aux_hidden_state_layer_ids"] = []
        cfg_file.write_text(json.dumps(d, indent=2))
    for n in ckpt.warnings:
        warnings.warn(n, stacklevel=2)
    return ImportReport(format=ckpt.source_format, source=src, path=out,
                        aux_layer_ids=list(ckpt.config.aux_layer_ids) if ckpt.aux_known else None,
                        dropped=dropped, warnings=list(ckpt.warnings))


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir():
        stale = sorted(p.name for p in out.iterdir() if p.name != "config.json" and p.name != WEIGHTS_FILE and (
            p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json")))
        if stale:
            raise ExportError(f"{out}: holds other weight files {stale}; use an empty directory")
        if not overwrite and any((out / n).exists() for n in ("config.json", WEIGHTS_FILE, MANIFEST_FILE)):
            raise ExportError(f"{out}: already holds a checkpoint; pass overwrite=True (--force) to replace it")
        # A leftover export manifest would make detect_format call the native checkpoint an engine layout.
        (out / MANIFEST_FILE).unlink(missing_ok=True)


def detect_format(path: str | Path) -> str:
    """Which layout a drafter directory is in: one of ``IMPORT_FORMATS``."""
    path = Path(path)
    raw = _read_config(path)
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (OSError, json.JSONDecodeError):
            fmt = None
        if fmt in EXPORT_FORMATS:
            return fmt
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return "speculators"
    if "draftsmith" in raw:
        return "draftsmith"
    if any(str(a).startswith("Eagle3") for a in raw.get("architectures") or []):
        return "vllm"
    if "eagle_config" in raw:
        return "sglang"
    if any(k.startswith(MIDLAYER_PREFIX) for k in _weight_names(path)):
        return "eagle"
    if "eagle_aux_hidden_state_layer_ids" in raw:
        return "vllm"
    return "eagle"


def read_checkpoint(path: str | Path, fmt: str = "auto", *, aux_layers=None,
                    dropped: list[str] | None = None) -> DrafterCheckpoint:
    """Any importable layout -> ``DrafterCheckpoint`` with draftsmith's names and aux id convention.

    ``aux_layers`` (draftsmith convention) overrides whatever the checkpoint says, or fills it in when the
    checkpoint says nothing (reference EAGLE-3 releases).
    """
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt not in IMPORT_FORMATS:
        raise ExportError(f"unknown import format {fmt!r}; choose auto or one of {', '.join(IMPORT_FORMATS)}")
    raw = _read_config(path)
    notes: list[str] = []
    dropped = dropped if dropped is not None else []
    flat = _flatten_config(raw, fmt, path)
    ids = _aux_ids(flat, path, notes) if aux_layers is None else [int(i) for i in aux_layers]
    aux_known = bool(ids)

    state = _read_weights(path)
    state = _canonical_names(state, path)
    if "lm_head.weight" in state and "draft_vocab_size" not in flat:
        flat["draft_vocab_size"] = int(state["lm_head.weight"].shape[0])
    if "fc.weight" not in state:
        raise ExportError(f"{path}: no fc.weight: not an EAGLE-3 drafter (EAGLE-1/2 drafters have no aux fusion)")
    if flat.get("target_hidden_size") is None:
        if aux_known:
            flat["target_hidden_size"] = state["fc.weight"].shape[1] // len(ids)
        else:
            flat["target_hidden_size"] = flat["hidden_size"]
    flat["eagle_aux_hidden_state_layer_ids"] = ids
    flat.pop("eagle_config", None)
    try:
        cfg = DrafterConfig.from_hf_config(flat)
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"{path}: config.json is not an EAGLE-3 drafter config ({type(e).__name__}: {e})") from e
    fc_in = state["fc.weight"].shape[1]
    if fc_in % cfg.target_hidden_size or (aux_known and fc_in != len(ids) * cfg.target_hidden_size):
        raise ExportError(f"{path}: fc.weight takes {fc_in} inputs, not {len(ids) if aux_known else 'k'} aux "
                          f"states x target_hidden_size {cfg.target_hidden_size}")
    rope = flat.get("rope_scaling") or flat.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in (None, "default"):
        notes.append(f"{path}: rope scaling {kind!r} ignored: draftsmith's drafter uses plain RoPE "
                     f"(theta {cfg.rope_theta}); logits can differ from the engine's at long positions")
    if not aux_known:
        notes.append(f"{path}: no aux layer ids recorded: the target's default (2, N//2, N-3) applies at load; "
                     "pass aux_layers (--aux-layers) if the drafter was trained on others")

    # An embedding of the drafter's own width that the target could supply is the target's (frozen) table:
    # engines and draftsmith share the target's instead.
    if "embed_tokens.weight" in state and cfg.hidden_size == cfg.target_hidden_size:
        state.pop("embed_tokens.weight")
        dropped.append("embed_tokens.weight (the target's table is shared at load)")
    _complete_vocab(state, cfg, path, notes)
    ours = raw.get("draftsmith") or {}
    cfg.target = ours.get("target") or _manifest(path).get("target") or {}
    return DrafterCheckpoint(config=cfg, state=state, aux_known=aux_known, source=str(path), source_format=fmt,
                             warnings=notes)


def _read_config(path: Path) -> dict:
    f = path / "config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path}: not a drafter directory (no config.json)")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{f}: not valid JSON ({e})") from e


def _manifest(path: Path) -> dict:
    f = path / MANIFEST_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _flatten_config(raw: dict, fmt: str, path: Path) -> dict:
    """One flat Llama-style dict whatever the layout; variants draftsmith cannot compute are refused here."""
    if fmt == "speculators":
        if raw.get("speculators_model_type", "eagle3") != "eagle3":
            raise ExportError(f"{path}: speculators_model_type {raw.get('speculators_model_type')!r} is not eagle3")
        flat = dict(raw.get("transformer_layer_config") or {})
        if not flat:
            raise ExportError(f"{path}: speculators config without transformer_layer_config")
        if flat.get("model_type", "llama") != "llama":
            raise ExportError(f"{path}: transformer_layer_config model_type {flat['model_type']!r}; only llama "
                              "EAGLE-3 layers are supported")
        for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *_UNSUPPORTED_SWITCHES):
            if raw.get(k) is not None:
                flat[k] = raw[k]
        # vLLM's speculators reader (algos.update_eagle3) defaults a missing field to True.
        flat["norm_before_residual"] = raw.get("norm_before_residual", True)
        flat.pop("eagle_config", None)
        archs = [VLLM_ARCHITECTURE]
    else:
        flat = dict(raw)
        archs = list(raw.get("architectures") or [])
    bad_arch = [a for a in archs if a not in LLAMA_EAGLE3_ARCHITECTURES]
    if bad_arch:
        raise ExportError(f"{path}: architecture {bad_arch[0]} is not a Llama-style EAGLE-3 drafter "
                          f"(supported: {', '.join(sorted(LLAMA_EAGLE3_ARCHITECTURES))})")
    on = [k for k in _UNSUPPORTED_SWITCHES if flat.get(k)]
    eagle_config = flat.get("eagle_config") or {}
    if eagle_config.get("norm_before_fc"):
        on.append("eagle_config.norm_before_fc")
    if eagle_config.get("use_aux_hidden_state") is False:
        on.append("eagle_config.use_aux_hidden_state=false")
    if on:
        raise ExportError(f"{path}: EAGLE-3 variant with {', '.join(on)}, which draftsmith's drafter does not "
                          "compute; converting it would change its outputs")
    if int(flat.get("num_hidden_layers", 1)) != 1:
        raise ExportError(f"{path}: {flat['num_hidden_layers']} decoder layers; only one-layer drafters are supported")
    return flat


def _aux_ids(flat: dict, path: Path, notes: list[str]) -> list[int]:
    """Top-level ids are vLLM's convention (input of layer L); ``eagle_config``'s are SGLang's (add one)."""
    top = flat.get("eagle_aux_hidden_state_layer_ids")
    nested = (flat.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = [int(i) for i in top] if top else None
    nested = from_sglang_layer_ids(nested) if nested else None
    if top and nested and top != nested:
        raise ExportError(
            f"{path}: the config names two different aux layer sets: top-level eagle_aux_hidden_state_layer_ids "
            f"{top} (vLLM reads these as input of layer L) and eagle_config's {to_sglang_layer_ids(nested)} (SGLang "
            f"adds one: {nested}). Pass the ones the drafter was trained on (--aux-layers, input-of-layer ids)")
    return top or nested or []


def _weight_names(path: Path) -> list[str]:
    from safetensors import safe_open

    f = path / WEIGHTS_FILE
    if f.is_file():
        with safe_open(str(f), framework="pt") as h:
            return list(h.keys())  # noqa: SIM118 (safe_open has no __iter__)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return []


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded safetensors index, or a pytorch_model.bin that holds tensors only."""
    from safetensors.torch import load_file

    if (path / WEIGHTS_FILE).is_file():
        return load_file(str(path / WEIGHTS_FILE))
    for index_name, loader in (("model.safetensors.index.json", "st"), ("pytorch_model.bin.index.json", "pt")):
        index = path / index_name
        if index.is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(load_file(str(path / shard)) if loader == "st" else _torch_load(path / shard))
            return state
    if (path / "pytorch_model.bin").is_file():
        return _torch_load(path / "pytorch_model.bin")
    shards = sorted(path.glob("*.safetensors"))
    if len(shards) == 1:
        return load_file(str(shards[0]))
    raise FileNotFoundError(f"{path}: no {WEIGHTS_FILE}, safetensors index or pytorch_model.bin")


def _torch_load(f: Path) -> dict[str, torch.Tensor]:
    """Tensors only (``weights_only=True``): a pickle that needs arbitrary code is refused, never run."""
    import pickle

    try:
        obj = torch.load(str(f), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        raise ExportError(f"{f}: cannot be read safely as tensors only ({' '.join(str(e).split())[:200]}); "
                          "convert it to safetensors with the tool that wrote it") from e
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ExportError(f"{f}: not a dict of tensors")
    return obj


def _canonical_names(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """``midlayer.`` -> ``layers.0.``, drop a leading ``model.``; refuse names draftsmith has no place for."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        name = canonical_weight_name(k)
        if name.endswith("rotary_emb.inv_freq"):  # a recomputed buffer some trainers save
            continue
        if name in out:
            raise ExportError(f"{path}: tensor {name} appears twice (as {k} and another name)")
        out[name] = v
    unknown = sorted(k for k in out if not is_drafter_weight(k))
    if unknown:
        raise ExportError(f"{path}: tensors draftsmith's EAGLE-3 drafter has no place for: {unknown[:8]}"
                          + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""))
    missing = sorted(set(REQUIRED_WEIGHTS) - set(out))
    if missing:
        raise ExportError(f"{path}: missing tensors {missing}")
    return out


def _complete_vocab(state: dict[str, torch.Tensor], cfg: DrafterConfig, path: Path, notes: list[str]) -> None:
    """Fill in d2t / t2d: each follows from the other; neither -> identity (what vLLM assumes too)."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    if d2t is not None and t2d is not None:
        dv = vocab_mod.DraftVocab(d2t=d2t.to(torch.int64), t2d=t2d.to(torch.bool))
    elif d2t is not None:
        dv = vocab_mod.from_target_ids(torch.arange(d2t.numel()) + d2t.to(torch.int64), cfg.vocab_size)
    elif t2d is not None:
        dv = vocab_mod.from_target_ids(torch.nonzero(t2d.to(torch.bool)).flatten(), t2d.numel())
    else:
        dv = vocab_mod.identity(cfg.vocab_size, cfg.draft_vocab_size)
        if cfg.draft_vocab_size < cfg.vocab_size:
            notes.append(f"{path}: no d2t/t2d: assuming the draft vocabulary is the first {cfg.draft_vocab_size} "
                         "target ids (identity); if it was trained on frequent tokens, acceptance will be near 0")
    try:
        vocab_mod.validate(dv.d2t, dv.t2d, cfg.vocab_size)
    except vocab_mod.VocabError as e:
        raise ExportError(f"{path}: {e}") from e
    if dv.draft_vocab_size != cfg.draft_vocab_size:
        raise ExportError(f"{path}: d2t has {dv.draft_vocab_size} entries, draft_vocab_size is {cfg.draft_vocab_size}")
    state["d2t"], state["t2d"] = dv.d2t, dv.t2d


__all__ = [
    "DTYPES", "EXPORT_FORMATS", "IMPORT_FORMATS", "MANIFEST_FILE", "DrafterCheckpoint", "ExportError",
    "ExportReport", "ImportReport", "detect_format", "export_drafter", "from_sglang_layer_ids",
    "import_drafter", "read_checkpoint", "target_embeddings", "to_sglang_layer_ids",
]
