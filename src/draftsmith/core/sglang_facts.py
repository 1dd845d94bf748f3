"""What SGLang serves for hybrid targets (recurrent layers beside attention), from its source and docs.

SGLang runs only on a GPU build here (sglang-kernel is CUDA), so these facts are read, not measured:
  * EAGLE-3 needs the target class to capture aux hidden states (``set_eagle3_layers_to_capture``). SGLang serves
    EAGLE drafters for Qwen3-Next (sgl-project/sglang docs/basic_usage/qwen3.md, "EAGLE Speculative Decoding";
    PR #10233), and SpecForge, which trains against SGLang's models, trains EAGLE-3 drafters for Qwen3-Next and
    Qwen3.5 (SpecForge #355, #496).
  * its LFM2 class captures aux states for DFlash only (``set_dflash_layers_to_capture``, no EAGLE-3 hook, in
    ``python/sglang/srt/models/lfm2.py``): a block drafter, not an EAGLE-3 one.
  * trees: SGLang verifies a draft tree on Mamba-2 and gated delta-net hybrids, a recurrent state per draft token
    (sgl-project/sglang#27463 runs ``--speculative-eagle-topk > 1`` on them, Qwen3-Next and Nemotron-H named), the
    only engine of the three that does.
Classes not named here are not known either way: doctor says it cannot tell.
"""

from __future__ import annotations

SOURCE = ("sgl-project/sglang docs/basic_usage/qwen3.md and python/sglang/srt/models/lfm2.py; SpecForge #355, #496; "
          "sgl-project/sglang#27463")
EAGLE3_HYBRID_TARGETS = frozenset({
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
})
# Hybrid classes SGLang serves block drafters for but has no EAGLE-3 capture hook in.
BLOCK_ONLY_HYBRID_TARGETS = frozenset({"Lfm2ForCausalLM"})
TREES_ON_HYBRIDS = True


def eagle3_on_hybrid(arch: str | None) -> bool | None:
    """True: SGLang serves an EAGLE-3 drafter for this hybrid class; False: it has no EAGLE-3 hook; None: unknown."""
    if arch in EAGLE3_HYBRID_TARGETS:
        return True
    if arch in BLOCK_ONLY_HYBRID_TARGETS:
        return False
    return None


__all__ = ["BLOCK_ONLY_HYBRID_TARGETS", "EAGLE3_HYBRID_TARGETS", "SOURCE", "TREES_ON_HYBRIDS", "eagle3_on_hybrid"]
