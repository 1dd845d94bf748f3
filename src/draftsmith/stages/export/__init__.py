"""Engine layouts of an EAGLE-3 drafter (SGLang, vLLM, speculators) and import back into draftsmith's own.

Every engine loads the same tensors under slightly different names and configs, and each mismatch fails
silently: SGLang skips unknown weight names, vLLM reads aux layer ids literally while SGLang adds one, the
speculators path assumes ``norm_before_residual = True`` when the field is absent. This module writes each
layout exactly as the engine's loader reads it and reads any of them (plus the SafeAILab reference and
SpecForge checkpoints) back into one canonical form, so ``import(export(x))`` is ``x``.

Aux layer id conventions (as vLLM's and SGLang's EAGLE-3 loaders read the config):
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

EAGLE-3.1 (the switches ``norm_before_fc``, ``fc_norm``, ``norm_output``; ``core.conventions.NORM_SWITCHES``):
  * every layout writes them top-level and explicit; the tensors keep one name everywhere: ``input_norm.weight``
    (norm_before_fc, width n_aux * target_hidden_size) and ``fc_norm.{i}.weight`` (one per aux state).
  * vLLM 0.32: llama_eagle3 reads all three (``eagle_config.norm_before_fc`` first) and feeds the post-norm state
    back under norm_output; speculators/algos.py copies all three (absent: false). It drops ``input_norm.*``
    when norm_before_fc is off. speculators 0.9: the same fields, norm_before_fc and fc_norm exclusive, and a
    missing ``input_norm.weight`` is ignored at load. SpecForge and SGLang read ``fc_norm`` and ``norm_output``.
  * the readers refuse a config whose switches and norm tensors disagree (a mislabelled drafter).
"""


from __future__ import annotations

from draftsmith.core.conventions import from_sglang_layer_ids, to_sglang_layer_ids
from draftsmith.stages.export.checkpoint import (
    DTYPES,
    EXPORT_FORMATS,
    IMPORT_FORMATS,
    LLAMA_EAGLE3_ARCHITECTURES,
    MANIFEST_FILE,
    SGLANG_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    VLLM_ARCHITECTURE,
    DrafterCheckpoint,
    ExportError,
)
from draftsmith.stages.export.readers import ImportReport, detect_format, import_drafter, read_checkpoint
from draftsmith.stages.export.writers import ExportReport, export_drafter, target_embeddings

__all__ = [
    "DTYPES", "EXPORT_FORMATS", "IMPORT_FORMATS", "LLAMA_EAGLE3_ARCHITECTURES", "MANIFEST_FILE",
    "SGLANG_ARCHITECTURE", "SPECULATORS_ARCHITECTURE", "VLLM_ARCHITECTURE", "DrafterCheckpoint", "ExportError",
    "ExportReport", "ImportReport", "detect_format", "export_drafter", "from_sglang_layer_ids",
    "import_drafter", "read_checkpoint", "target_embeddings", "to_sglang_layer_ids",
]
