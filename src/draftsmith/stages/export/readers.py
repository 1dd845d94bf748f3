"""Read any EAGLE-3 layout (reference, SpecForge, SGLang, vLLM, speculators, draftsmith) into one canonical form."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import (
    NORM_SWITCHES,
    REQUIRED_WEIGHTS,
    canonical_weight_name,
    from_sglang_layer_ids,
    is_drafter_weight,
    norm_mismatches,
    norm_switches,
    to_sglang_layer_ids,
)
from draftsmith.core.errors import one_line
from draftsmith.core.io import carry_over, replace_dir, restore_dir, staging_dir
from draftsmith.core.layouts import detect_layout
from draftsmith.core.tensorfile import CorruptWeightsError, corrupt_weights_named
from draftsmith.model.drafter import WEIGHTS_FILE, DrafterConfig, check_config_sizes
from draftsmith.stages.export.checkpoint import (
    _UNSUPPORTED_SWITCHES,
    IMPORT_FORMATS,
    LLAMA_EAGLE3_ARCHITECTURES,
    MANIFEST_FILE,
    VLLM_ARCHITECTURE,
    DrafterCheckpoint,
    ExportError,
)


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
    if out.is_symlink():  # the swap below replaces a directory: the one the link names
        out = out.resolve()
    restore_dir(out)
    _check_out(out, overwrite)
    # Written whole into a sibling, then swapped in (core.io.replace_dir): a kill during --force over an older
    # import leaves that one or this one, never this one's weights under its config.
    staging = staging_dir(out)
    try:
        drafter.save(staging)
        if not ckpt.aux_known:  # save() wrote the placeholder ids build() needed; record "unknown" instead
            cfg_file = staging / "config.json"
            d = json.loads(cfg_file.read_text())
            d["eagle_aux_hidden_state_layer_ids"] = []
            cfg_file.write_text(json.dumps(d, indent=2))
        if out.is_dir():
            carry_over(out, staging, skip={"config.json", WEIGHTS_FILE, MANIFEST_FILE})
        replace_dir(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
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
        # A leftover export manifest would make detect_format call the native checkpoint an engine layout: the
        # swap leaves it behind (carry_over skips it).


def detect_format(path: str | Path) -> str:
    """Which layout a drafter directory is in: one of ``IMPORT_FORMATS`` (core/layouts.py decides)."""
    path = Path(path)
    raw = _read_config(path)
    try:
        return detect_layout(path, raw)
    except ValueError as e:  # a weights header that does not parse
        raise CorruptWeightsError(f"{path / WEIGHTS_FILE}: not a valid safetensors file (truncated or corrupt): "
                                  f"{one_line(e)}") from e


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
        raise ExportError(f"{path / 'config.json'}: not an EAGLE-3 drafter config ({type(e).__name__}: {e})") from e
    check_config_sizes(cfg, path / "config.json", sum(t.numel() for t in state.values()))
    mislabelled = norm_mismatches(cfg.norm_flags(), state, len(ids) if aux_known else None)
    if mislabelled:
        raise ExportError(f"{path}: the EAGLE-3.1 norms in config.json and the weights disagree: "
                          f"{'; '.join(mislabelled)} (a drafter trained without a norm labelled with it, or the "
                          "reverse); converting it would change its outputs")
    if cfg.norm_output and fmt in ("sglang", "eagle") and not _manifest(path):
        notes.append(f"{path}: norm_output = true: SpecForge before its PR #879 (2026-09) trained such drafters "
                     "feeding back the un-normed state; if this one is older, it drafts as EAGLE-3 (norm_output "
                     "false) and its acceptance will be low here")
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
        raw = json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ExportError(f"{f}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ExportError(f"{f}: not an EAGLE-3 drafter config (a JSON {type(raw).__name__}, not an object)")
    return raw


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
        for k in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", *NORM_SWITCHES,
                  *_UNSUPPORTED_SWITCHES):
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
    nested = eagle_config.get("norm_before_fc")
    if nested is not None and "norm_before_fc" in flat and bool(nested) != bool(flat["norm_before_fc"]):
        raise ExportError(f"{path}: eagle_config.norm_before_fc = {nested} but the top-level norm_before_fc = "
                          f"{flat['norm_before_fc']}: vLLM reads the first, other engines the second")
    flat.update(norm_switches(flat))  # eagle_config's norm_before_fc (what vLLM reads first) made top-level
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


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, a sharded safetensors index, or a pytorch_model.bin that holds tensors only."""
    from safetensors.torch import load_file as _load_file

    def load_file(f: str) -> dict[str, torch.Tensor]:
        with corrupt_weights_named(f):
            return _load_file(f)

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
