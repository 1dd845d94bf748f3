"""Which EAGLE-3 checkpoint layout a drafter directory is in, read from its JSON and safetensors header alone.

Kept free of torch so that ``doctor`` classifies a drafter in well under a second; the readers in
``stages/export`` use the same function, so a layout is recognised in one place.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.core.conventions import MIDLAYER_PREFIX

EXPORT_FORMATS = ("sglang", "vllm", "speculators")
IMPORT_FORMATS = ("eagle", "sglang", "vllm", "speculators", "draftsmith")
MANIFEST_FILE = "draftsmith-export.json"  # what `draftsmith export` writes beside an engine layout
WEIGHTS_FILE = "model.safetensors"

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


def detect_layout(path: Path, raw: dict) -> str:
    """One of ``IMPORT_FORMATS`` for the drafter directory ``path`` whose parsed config.json is ``raw``."""
    manifest = path / MANIFEST_FILE
    if manifest.is_file():
        try:
            fmt = json.loads(manifest.read_text()).get("format")
        except (OSError, json.JSONDecodeError, AttributeError):
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
    if any(k.startswith(MIDLAYER_PREFIX) for k in weight_names(path)):
        return "eagle"
    if "eagle_aux_hidden_state_layer_ids" in raw:
        return "vllm"
    return "eagle"


def weight_names(path: Path) -> list[str]:
    """Tensor names of the directory's checkpoint (single file or sharded index), from headers only."""
    from draftsmith.core.tensorfile import read_safetensors_header

    f = path / WEIGHTS_FILE
    if f.is_file():
        return list(read_safetensors_header(f))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return []
