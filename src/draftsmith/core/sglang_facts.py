"""What SGLang serves for hybrid targets (recurrent layers beside attention), read from its source.

SGLang runs only on a GPU build (sglang-kernel is CUDA), so these facts are read, not measured. Source: the
``sglang==0.5.23`` wheel from PyPI, ``sglang/srt/models/*.py``. A target feeds a drafter aux hidden states only
through a hook on its class: ``set_eagle3_layers_to_capture`` for EAGLE-3, ``set_dflash_layers_to_capture`` for
DFlash.
  * both hooks: Qwen3NextForCausalLM (qwen3_next.py), Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM (qwen3_5.py), and
    the Qwen3.5 ForConditionalGeneration wrappers (they inherit Qwen3VLForConditionalGeneration's, qwen3_vl.py).
    SpecForge trains EAGLE-3 drafters for Qwen3-Next and Qwen3.5 against these classes (SpecForge #355, #496).
  * DFlash only: Lfm2ForCausalLM, Lfm2MoeForCausalLM (lfm2.py, lfm2_moe.py), NemotronHForCausalLM and its Puzzle
    variant (nemotron_h.py).
  * neither: GraniteMoeHybridForCausalLM, FalconH1ForCausalLM, KimiLinearForCausalLM.
  * trees: SGLang verifies a draft tree on Mamba-2 and gated delta-net hybrids, a recurrent state per draft token
    (sgl-project/sglang#27463 runs ``--speculative-eagle-topk > 1`` on them, Qwen3-Next and Nemotron-H named).
Classes not named here (Jamba, Bamba: no model file in 0.5.23) are not known either way: doctor says it cannot tell.
"""

from __future__ import annotations

VERSION = "0.5.23"
SOURCE = (f"sglang {VERSION} source: srt/models/*.py, set_eagle3_layers_to_capture / set_dflash_layers_to_capture; "
          "trees on hybrids: sgl-project/sglang#27463")
EAGLE3_HYBRID_TARGETS = frozenset({
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
})
# Hybrid classes with a DFlash hook and no EAGLE-3 one.
BLOCK_ONLY_HYBRID_TARGETS = frozenset({"Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "NemotronHForCausalLM",
                                       "NemotronHPuzzleForCausalLM"})
# Hybrid classes SGLang runs without either hook: no drafter that reads aux states is served.
NO_HOOK_HYBRID_TARGETS = frozenset({"GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM", "KimiLinearForCausalLM"})
TREES_ON_HYBRIDS = True


def serves_on_hybrid(arch: str | None, *, block: bool = False) -> bool | None:
    """Does SGLang feed an EAGLE-3 (``block``: DFlash) drafter aux states on this hybrid class? None: unknown."""
    if arch in EAGLE3_HYBRID_TARGETS:
        return True
    if arch in BLOCK_ONLY_HYBRID_TARGETS:
        return block
    if arch in NO_HOOK_HYBRID_TARGETS:
        return False
    return None


def eagle3_on_hybrid(arch: str | None) -> bool | None:
    """True: SGLang serves an EAGLE-3 drafter for this hybrid class; False: it has no EAGLE-3 hook; None: unknown."""
    return serves_on_hybrid(arch)


__all__ = ["BLOCK_ONLY_HYBRID_TARGETS", "EAGLE3_HYBRID_TARGETS", "NO_HOOK_HYBRID_TARGETS", "SOURCE", "TREES_ON_HYBRIDS",
           "VERSION", "eagle3_on_hybrid", "serves_on_hybrid"]
