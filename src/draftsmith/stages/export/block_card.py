"""The model card of a block drafter (DFlash, DSpark): the same README.md + drafter_card.json as an EAGLE-3 export
(``card.py``), with what a block drafter adds: its block size and slot convention (the fault SGLang #30852 shows
as 1.1 instead of 4.05 is a drafter read with the other one), its mask token, and the serve lines of the engines
that read its layout. The expected acceptance is training's held-out evaluation (``eval.json``) per draft
position of the block, and the acceptance length of each prefix of it.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path

from draftsmith.core import block_facts as bf
from draftsmith.stages.export.card import (
    CARD_SCHEMA,
    benchmark_rows,
    card_sources,
    draft_ids_hash,
    expected_acceptance,
    versions,
)

#: Engines whose serve line a block export's card prints, per layout.
BLOCK_ENGINES = {"vllm": ("vllm",), "speculators": ("vllm",), "sglang": ("sglang",), "gguf": ("llama.cpp",)}


def block_usage_lines(spec, fmt: str, where: str, base_model: str | None, target_gguf: str | None = None) -> dict:
    target = base_model or "TARGET"
    out = {}
    for engine in BLOCK_ENGINES.get(fmt, ()):
        if engine == "vllm":
            cfg = {"method": spec.kind, "model": where, "num_speculative_tokens": spec.drafts}
            out["vllm"] = (f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(cfg))}"
                           if fmt != "speculators" else f"vllm serve {shlex.quote(where)}")
        elif engine == "sglang":
            out["sglang"] = (f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
                             f"--speculative-algorithm {spec.kind.upper()} --speculative-draft-model-path "
                             f"{shlex.quote(where)} --speculative-num-draft-tokens {spec.drafts + 1}")
        elif engine == "llama.cpp":
            out["llama.cpp"] = (f"llama-server -m {shlex.quote(target_gguf or 'TARGET.gguf')} --model-draft "
                                f"{shlex.quote(where)} --spec-type draft-{spec.kind} --draft-max {spec.drafts} "
                                "--draft-min 0" + (" --spec-draft-p-min 0" if spec.kind == "dspark" else ""))
    return out


def block_card_facts(*, spec, fmt: str, out: str | Path, source: str | Path | None, base_model: str | None,
                     files: Sequence[str], d2t=None, license: str | None = None,
                     bench_reports: Sequence[str | Path] = (), repo_id: str | None = None,
                     target_gguf: str | None = None, engines: dict[str, str] | None = None) -> dict:
    """Everything a block drafter's card says, as one JSON-able dict (``drafter_card.json``)."""
    src_dir, training, base, where = card_sources(source, base_model, out, repo_id)
    return {
        "schema": CARD_SCHEMA,
        "kind": spec.kind,
        "format": fmt,
        "files": sorted(files),
        "base_model": base,
        "target_fingerprint": dict(spec.target),
        "license": license,
        "num_speculative_tokens": spec.drafts,
        "block_size": spec.block_size,
        "slot": spec.slot,
        "slot_meaning": {bf.FILL_IN: "fill-in: the block is [last token, mask...], every slot drafts the next token",
                         bf.ANCHOR_FIRST: "anchor-first: slot 0 holds the sampled anchor, the drafts follow"}.get(
                             spec.slot, spec.slot),
        "mask_token_id": spec.mask_token_id,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "aux_layer_ids_convention": "input of target layer L (vLLM aux, speculators, llama.cpp, draftsmith)",
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "markov_rank": spec.markov_rank if spec.kind == "dspark" else None,
        "expected_acceptance": expected_acceptance(src_dir),
        "benchmarks": benchmark_rows(bench_reports),
        "training": training,
        "versions": versions(engines),
        "draft_ids_sha256": draft_ids_hash(d2t, spec.draft_vocab_size, spec.vocab_size),
        "usage": block_usage_lines(spec, fmt, where, base, target_gguf),
    }


__all__ = ["BLOCK_ENGINES", "block_card_facts", "block_usage_lines"]
