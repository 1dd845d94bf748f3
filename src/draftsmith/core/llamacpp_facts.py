"""What llama.cpp's EAGLE-3 support reads and serves, checked against the engine users install.

Checked against PyPI ``xllamacpp==2026.10.11549`` (a prebuilt CPU build of llama.cpp with EAGLE-3) and llama.cpp's
``src/models/eagle3.cpp``:
  * a drafter is a GGUF of architecture ``eagle3``; ``eagle3.target_layers`` (exactly 3 ids, else the load fails:
    "EAGLE3 requires exactly 3 entries") and ``eagle3.target_hidden_size`` are required; ``eagle3.norm_before_residual``
    is optional (default false). No other drafter switch is read: a drafter that needs one cannot be served.
  * an aux id names the *input* of that target layer (Hugging Face ``hidden_states[id]``), as draftsmith and vLLM
    count them; the target's graph must expose layer inputs, which only some architectures' graphs do. Any other
    target loads, then aborts at the first decode (measured on a qwen2 GGUF: GGML_ASSERT "layer input tensor is
    null", SIGABRT, the whole process).
  * drafting is a chain (``speculative.draft.n_max`` tokens per round); no trees.

Hybrid targets (ggml-org/llama.cpp ``src/models/*.cpp``): a graph exposes layer inputs with
``res->t_layer_inp[il] = inpL`` at the top of its layer loop; DFlash and DSpark read the same tensors (the same
GGML_ASSERT stops them), so the list holds for every drafter kind. ``qwen35.cpp`` (06e514f) and ``qwen35moe.cpp``
(02ebd8f) set it, and the LFM2 graph does in the build checked above; ``qwen3next.cpp`` (02ebd8f),
``granite-hybrid.cpp`` (4499a65; Granite-4 and Bamba convert to it), ``nemotron-h.cpp`` (0aebd86),
``falcon-h1.cpp`` and ``jamba.cpp`` do not. A recurrent state cannot be verified as a tree: llama.cpp's chain-only
drafting is also the only way it could serve one.
"""

from __future__ import annotations

from collections.abc import Iterable

GGUF_ARCH = "eagle3"
KEY_TARGET_LAYERS = "eagle3.target_layers"
KEY_TARGET_LAYERS_EARLY = "eagle3.extract_layers"  # the same ids, as builds before the rename read them
KEY_TARGET_HIDDEN_SIZE = "eagle3.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = "eagle3.norm_before_residual"
N_AUX = 3

# Target architectures (GGUF general.architecture) whose llama.cpp graph exposes layer inputs to EAGLE-3.
TARGET_ARCHES = frozenset({"llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "gemma4", "gpt-oss", "lfm2"})
# Architectures users try that load but abort at the first decode (their graph extracts nothing).
UNSUPPORTED_TARGET_ARCHES = frozenset({"qwen2", "gemma3", "phi3", "smollm3", "qwen3next", "granitehybrid", "nemotron_h",
                                       "falcon-h1", "jamba"})
# Architectures whose graph keeps a recurrent state in some layers (gated delta-net, Mamba, short convolutions).
RECURRENT_ARCHES = frozenset({"qwen35", "qwen35moe", "qwen3next", "lfm2", "granitehybrid", "nemotron_h", "falcon-h1",
                              "jamba"})

# Hugging Face model_type -> GGUF general.architecture, for targets known by their config.json.
_HF_TO_GGUF = {
    "llama": "llama", "mistral": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen3_5": "qwen35",
    "qwen3_5_text": "qwen35", "gemma4": "gemma4", "gemma4_text": "gemma4", "gpt_oss": "gpt-oss", "lfm2": "lfm2",
    "qwen2": "qwen2", "gemma3": "gemma3", "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3",
    "qwen3_5_moe": "qwen35moe", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next",
    "granitemoehybrid": "granitehybrid", "bamba": "granitehybrid", "nemotron_h": "nemotron_h",
    "falcon_h1": "falcon-h1", "jamba": "jamba",
}
_HF_CLASS_TO_GGUF = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe", "GptOssForCausalLM": "gpt-oss", "Lfm2ForCausalLM": "lfm2",
    "Qwen2ForCausalLM": "qwen2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3", "Qwen3NextForCausalLM": "qwen3next", "Qwen3_5ForCausalLM": "qwen35",
    "Qwen3_5MoeForCausalLM": "qwen35moe", "GraniteMoeHybridForCausalLM": "granitehybrid",
    "BambaForCausalLM": "granitehybrid", "NemotronHForCausalLM": "nemotron_h", "FalconH1ForCausalLM": "falcon-h1",
    "JambaForCausalLM": "jamba",
}

# Drafter config switches the engine reads, and EAGLE-3.1 ones it does not (a drafter trained with one of these on
# would be served without it: wrong drafts, no error).
# fc_norm is one of them: the graph has no per-state norm before fc, and a drafter GGUF holding fc_norm.{i} tensors is
# refused at load ("wrong number of tensors").
READS_NORMS = ("norm_before_residual",)
UNREAD_NORMS = ("norm_before_fc", "fc_norm", "norm_output")

# The drafter GGUF's tensors: every one of these must be there ("check_tensor_dims: tensor 'fc.weight' not found"),
# and no other than these and the optional ones ("done_getting_tensors: wrong number of tensors"). d2t may be left
# out when the draft vocabulary is the target's (output.weight then has a row per target token); token_embd only
# when the drafter has its own embedding.
DRAFTER_TENSORS = frozenset({"fc.weight", "output_norm.weight", "output.weight", *(
    f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))})
OPTIONAL_DRAFTER_TENSORS = frozenset({"d2t", "token_embd.weight"})


def gguf_arch(model_type: str | None = None, architecture: str | None = None) -> str | None:
    """The GGUF architecture name llama.cpp gives a target known by HF model_type or class name (None: unknown)."""
    if model_type and model_type in _HF_TO_GGUF:
        return _HF_TO_GGUF[model_type]
    if architecture and architecture in _HF_CLASS_TO_GGUF:
        return _HF_CLASS_TO_GGUF[architecture]
    return model_type if model_type in TARGET_ARCHES | UNSUPPORTED_TARGET_ARCHES else None


def target_supported(arch: str | None) -> bool | None:
    """True when llama.cpp drafts for this GGUF architecture, False when it aborts, None when unknown."""
    if arch is None:
        return None
    return arch in TARGET_ARCHES


def engine_unread_norms(switches: dict) -> list[str]:
    """The drafter switches that are on but that llama.cpp's EAGLE-3 graph never reads."""
    return [name for name in UNREAD_NORMS if bool(switches.get(name))]


def aux_ids_in_range(ids: Iterable[int], num_layers: int | None) -> bool:
    ids = list(ids)
    return num_layers is None or all(0 <= i < num_layers for i in ids)
