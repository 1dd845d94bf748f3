"""What an engine reads from a drafter's files: aux ids, draft vocabulary, norm switches (for the card comparison)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch


def _ids_hash(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def _d2t_hashes(d2t: torch.Tensor | None, absolute: bool) -> dict:
    """The draft vocabulary as the engine reads it (absolute target ids), and read the other way."""
    if d2t is None:
        return {"draft_ids_sha256": None, "draft_ids_sha256_other_convention": None}
    d2t = d2t.to(torch.int64)
    ar = torch.arange(d2t.numel(), dtype=torch.int64)
    read, other = (d2t, ar + d2t) if absolute else (ar + d2t, d2t)
    return {"draft_ids_sha256": _ids_hash(read), "draft_ids_sha256_other_convention": _ids_hash(other),
            "draft_ids_identity": bool(torch.equal(read, ar))}  # offsets of zeros: a d2t that maps nothing


def served_facts(drafter: str | Path, engine: str, target: str | Path | None = None,
                 openvino_python: str | Path | None = None) -> dict:
    """What ``engine`` reads from the drafter's files (a .gguf for llama.cpp, an HF-layout folder for vLLM, a draft
    IR for OpenVINO GenAI)."""
    from draftsmith.core import openvino_facts

    p = Path(drafter)
    if p.suffix == ".gguf":
        return _gguf_facts(p)
    if (p / openvino_facts.DRAFT_XML).is_file():
        return _ir_facts(p, target, openvino_python)
    return _hf_facts(p, engine, target)


def _gguf_facts(path: Path) -> dict:
    from draftsmith.core import llamacpp_facts as facts
    from draftsmith.core.gguf_file import open_gguf

    r = open_gguf(path)
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("eagle3.")}
    d2t = next((torch.from_numpy(t.data.copy()) for t in r.tensors if t.name == "d2t"), None)
    return {"aux_layer_ids": list(f.get(facts.KEY_TARGET_LAYERS) or []) or None,
            "norm_before_residual": bool(f.get(facts.KEY_NORM_BEFORE_RESIDUAL, False)),
            "norms": {}, **_d2t_hashes(d2t, absolute=True)}


def _hf_facts(path: Path, engine: str, target: str | Path | None) -> dict:
    from safetensors import safe_open

    cfg = json.loads((path / "config.json").read_text())
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(cfg.get("eagle_config"), dict):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and engine == "sglang":
            ids = [i + 1 for i in ids]  # SGLang's loader adds one; vLLM takes them literally
    speculators = "speculators_config" in cfg
    nbr = cfg.get("norm_before_residual", speculators)  # speculators' default when absent
    norms = {k: bool(cfg.get(k, False)) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    d2t = None
    weights = path / "model.safetensors"
    if weights.is_file():
        with safe_open(str(weights), "pt") as f:
            if "d2t" in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                d2t = f.get_tensor("d2t")
    out = {"aux_layer_ids": list(ids) if ids is not None else None, "norm_before_residual": bool(nbr),
           "norms": norms, **_d2t_hashes(d2t, absolute=False)}
    if target is not None:
        out["target_fingerprint"] = _target_fingerprint(target)
    return out


def _ir_facts(path: Path, target: str | Path | None, python: str | Path | None) -> dict:
    """The draft IR as GenAI reads it: the tapped layers from rt_info (GenAI's default [2, N/2, N-3] when it names
    none), d2t from the IR's constant (read in OpenVINO's environment), and no norm switch at all: optimum-intel's
    EAGLE-3 graph implements none of them (core/openvino_facts.py)."""
    from draftsmith.core import openvino_facts as facts
    from draftsmith.integrations.openvino import run_worker

    listed = facts.read_hidden_layers((path / facts.DRAFT_XML).read_text())
    tdir = _target_dir(target)
    if listed is None and tdir is not None:
        cfg = json.loads((tdir / "config.json").read_text())
        layers = (cfg.get("text_config") or cfg).get("num_hidden_layers")
        listed = facts.genai_default_layer_ids(int(layers)) if layers else None
    seen = run_worker({"op": "inspect-draft", "xml": str(path / facts.DRAFT_XML)}, python=python, timeout=600)
    d2t = torch.tensor(seen["d2t"]["values"], dtype=torch.int64) if seen.get("d2t") else None
    out = {"aux_layer_ids": facts.from_genai_layer_ids(listed) if listed is not None else None,
           "norm_before_residual": False, "norms": {k: False for k in ("norm_before_fc", "fc_norm", "norm_output")},
           **_d2t_hashes(d2t, absolute=False)}
    if tdir is not None:
        out["target_fingerprint"] = _target_fingerprint(tdir)
    return out


def _target_dir(target: str | Path | None) -> Path | None:
    """The target's Hugging Face folder (the embedded default's cache for 'smollm2'), or None."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    if target is None:
        return None
    p = ensure_smollm2() if str(target) == EMBEDDED_DEFAULT else Path(target)
    return p if (p / "config.json").is_file() else None


def _target_fingerprint(target: str | Path) -> dict | None:
    """The target's fingerprint as draftsmith records it (None where its config cannot be read here)."""
    from draftsmith.core.fingerprint import config_fingerprint

    p = Path(target)
    if not (p.is_dir() and (p / "config.json").is_file()):
        return None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(p)
    except (OSError, ValueError):
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return {"config_sha256": config_fingerprint(text)}
