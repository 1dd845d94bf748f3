"""``export --format openvino``: an EAGLE-3 drafter as the OpenVINO IR that GenAI's ``draft_model()`` loads.

The path (core/openvino_facts.py has the facts): the SGLang layout (``LlamaForCausalLMEagle3``, which optimum-intel
maps to its own EAGLE-3 graph), with the target's embedding and tokenizer in it, converted by optimum-intel's
``optimum-cli export openvino`` in OpenVINO's own environment; then the tapped target layers written into the IR's
rt_info in GenAI's numbering (draftsmith's ids minus one; optimum-intel writes none, and GenAI's default is a layer
deep for a drafter trained on draftsmith's defaults), and the IR's d2t read back to prove it holds draftsmith's
int64 offsets. The target must be an OpenVINO model too: ``openvino_target`` converts it once into the cache.

Refused before anything is converted: drafters whose computation the exported graph would not carry
(``norm_before_residual``, the EAGLE-3.1 norms), a count of tapped layers other than 3, or a tap at layer 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.core import openvino_facts as facts
from draftsmith.core.errors import UsageError
from draftsmith.core.io import atomic_write
from draftsmith.core.machine import cache_home
from draftsmith.stages.export.checkpoint import ExportError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "generation_config.json")
WEIGHT_FORMATS = ("fp32", "fp16", "int8")


@dataclass
class OpenVinoExportReport:
    path: Path
    aux_layer_ids: list[int]  # draftsmith's convention
    hidden_layers_list: list[int]  # GenAI's, as written into the IR
    weight_format: str
    d2t_type: str | None
    target_ir: Path | None = None
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"exported openvino drafter to {self.path} ({self.weight_format} weights)",
                 f"aux layer ids {self.aux_layer_ids} (input of layer L) -> hidden_layers_list "
                 f"{self.hidden_layers_list} in the IR's rt_info (GenAI: output of layer i)",
                 f"d2t: {self.d2t_type or 'none (full vocabulary)'}"]
        if self.target_ir:
            lines.append(f"target IR: {self.target_ir}")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def check_drafter(ckpt, switches: dict) -> list[int]:
    """GenAI's ``hidden_layers_list`` for this drafter, or ExportError naming what the exported graph would drop."""
    dropped = facts.unread_switches({n: bool(switches.get(n)) or bool(getattr(ckpt.config, n, False))
                                     for n in facts.UNREAD_SWITCHES})
    if dropped:
        raise ExportError(f"{', '.join(dropped)} on: optimum-intel's EAGLE-3 graph (what OpenVINO GenAI runs) does not "
                          "implement it, so the drafter would be served as another network, silently; train without "
                          "it for OpenVINO")
    if not ckpt.aux_known:
        raise ExportError("the drafter does not say which target layers it reads; re-import it with --aux-layers")
    return facts.to_genai_layer_ids(ckpt.config.aux_layer_ids)


def sglang_source(ckpt, target_dir: Path, hf: Path) -> Path:
    """The folder optimum-intel converts: the SGLang layout in fp32, the target's embedding and tokenizer in it."""
    from draftsmith.stages.export.writers import export_drafter, target_embeddings

    export_drafter(ckpt, hf, "sglang", dtype="fp32", include_embeddings=not ckpt.has_own_embedding,
                   embeddings=None if ckpt.has_own_embedding else target_embeddings(target_dir))
    for name in TOKENIZER_FILES:  # draft_model() loads a tokenizer from the draft's folder
        if (target_dir / name).is_file():
            shutil.copy2(target_dir / name, hf / name)
    return hf


def fix_layer_ids(xml: Path, genai_ids: list[int]) -> None:
    """Write ``hidden_layers_list`` into the IR's rt_info, atomically."""
    text = xml.read_text()
    atomic_write(xml, facts.with_hidden_layers(text, genai_ids).encode())


def target_source_dir(target: str | Path) -> Path:
    """A Hugging Face folder optimum-intel converts: the embedded default's safetensors cache, or the given folder."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    if str(target) == EMBEDDED_DEFAULT:
        return ensure_smollm2()
    p = Path(target).expanduser()
    if not (p / "config.json").is_file():
        raise UsageError(f"{target}: OpenVINO's converter needs the target's Hugging Face folder (config.json and "
                         "safetensors), or smollm2")
    return p


def openvino_target(target: str | Path, weight_format: str = "fp32", *, python: str | Path | None = None) -> Path:
    """The target as an OpenVINO IR folder: converted once (optimum-intel) into draftsmith's cache, atomically."""
    from draftsmith.integrations.openvino import optimum_export

    if weight_format not in WEIGHT_FORMATS:
        raise UsageError(f"--openvino-weights {weight_format}: choose one of {', '.join(WEIGHT_FORMATS)}")
    src = target_source_dir(target)
    if (src / facts.DRAFT_XML).is_file():  # already an IR folder
        return src
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:10]
    key = f"{src.resolve().name}-{digest}-{weight_format}"
    out = cache_home() / "openvino" / key
    if (out / facts.DRAFT_XML).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".target-", dir=out.parent))
    try:
        optimum_export(src, tmp, weight_format=weight_format, python=python)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_openvino(drafter, out: str | Path, *, target: str | Path, weight_format: str = "fp32",
                    overwrite: bool = False, python: str | Path | None = None,
                    with_target: bool = False, card: dict | None = None,
                    num_speculative_tokens: int | None = None) -> OpenVinoExportReport:
    """Write ``drafter`` (object or directory) as GenAI's draft IR into ``out``; ``target``: HF folder or smollm2.
    The model card (README.md + drafter_card.json; ``card``: its extra facts) is written into the folder before it
    is swapped in, so the IR never sits under another export's card."""
    from draftsmith.integrations.openvino import optimum_export, run_worker
    from draftsmith.stages.export.card import CARD_FILE
    from draftsmith.stages.export.gguf import read_drafter

    if weight_format not in WEIGHT_FORMATS:
        raise UsageError(f"--openvino-weights {weight_format}: choose one of {', '.join(WEIGHT_FORMATS)}")
    from draftsmith.stages.export.card import chain_k

    num_speculative_tokens = chain_k(num_speculative_tokens, drafter, (card or {}).get("decoded"))
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: not empty; pass --force to replace it")
    ckpt, switches = read_drafter(drafter)
    genai_ids = check_drafter(ckpt, switches)
    src = target_source_dir(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".openvino-", dir=out.parent))
    try:
        hf = sglang_source(ckpt, src, work / "sglang")
        ir = work / "ir"
        optimum_export(hf, ir, weight_format=weight_format, python=python)
        xml = ir / facts.DRAFT_XML
        fix_layer_ids(xml, genai_ids)
        seen = run_worker({"op": "inspect-draft", "xml": str(xml)}, python=python)
        d2t_type = _check_ir(seen, genai_ids, ckpt)
        manifest = {"format": "openvino", "aux_layer_ids": list(ckpt.config.aux_layer_ids),
                    "hidden_layers_list": genai_ids, "weight_format": weight_format, "d2t": d2t_type,
                    "versions": seen.get("versions", {})}
        atomic_write(ir / "draftsmith-export.json", (json.dumps(manifest, indent=2) + "\n").encode())
        _write_card(ir, out, ckpt, drafter, target, num_speculative_tokens, card, seen.get("versions", {}))
        if out.exists():
            if (out / CARD_FILE).is_file() and not (ir / CARD_FILE).exists():  # the user's README.md, kept
                shutil.copy2(out / CARD_FILE, ir / CARD_FILE)
            shutil.rmtree(out)
        os.replace(ir, out)  # the folder appears whole or not at all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = OpenVinoExportReport(out, list(ckpt.config.aux_layer_ids), genai_ids, weight_format, d2t_type)
    if with_target:
        report.target_ir = openvino_target(target, weight_format, python=python)
    return report


def _write_card(ir: Path, out: Path, ckpt, drafter, target, k: int, card: dict | None, versions: dict) -> None:
    from draftsmith.stages.export.card import base_model_of, card_facts, write_card

    extra = dict(card or {})
    base = extra.pop("base_model", None) or base_model_of(target)
    source = drafter if isinstance(drafter, (str, Path)) else None
    files = sorted(p.name for p in ir.iterdir() if p.is_file())
    engines = {"openvino-genai": versions["openvino-genai"]} if versions.get("openvino-genai") else None
    facts = card_facts(fmt="openvino", out=out, drafter_config=ckpt.config, source=source, base_model=base,
                       num_speculative_tokens=k, files=files, d2t=ckpt.state.get("d2t"),
                       **({"engines": engines} if engines and "engines" not in extra else {}), **extra)
    write_card(ir, facts, beside=out if out.is_dir() else None)


def _check_ir(seen: dict, genai_ids: list[int], ckpt) -> str | None:
    """The converted IR as GenAI reads it: the layer list it will tap, and d2t as int64 offsets equal to ours."""
    rt = seen.get("rt_info", {})
    if str(rt.get(facts.RT_EAGLE3_MODE, "")).lower() != "true":
        raise ExportError(f"optimum-intel wrote no rt_info eagle3_mode=True (got {rt}): GenAI would not run it as "
                          "an EAGLE-3 draft")
    listed = [int(x) for x in str(rt.get(facts.RT_HIDDEN_LAYERS, "")).replace(",", " ").split()]
    if listed != genai_ids:
        raise ExportError(f"the IR's hidden_layers_list reads back as {listed}, expected {genai_ids}")
    d2t = seen.get("d2t")
    if d2t is None:
        raise ExportError("the IR has no d2t output: GenAI would map draft ids to target ids unchanged")
    want = [int(x) for x in ckpt.state["d2t"].tolist()]
    if d2t["type"] != "i64":
        raise ExportError(f"the IR's d2t is {d2t['type']}; GenAI's sampler reads int64 offsets")
    if d2t["values"] != want:
        raise ExportError("the IR's d2t differs from the drafter's (GenAI adds d2t[i] to draft id i)")
    return d2t["type"]


__all__ = ["OpenVinoExportReport", "WEIGHT_FORMATS", "check_drafter", "export_openvino", "fix_layer_ids",
           "openvino_target", "sglang_source", "target_source_dir"]
