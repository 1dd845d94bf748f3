"""doctor for block drafters (DFlash, DSpark): what the engine checked against does with this drafter and target.

Read from config.json alone (no weights): the kind, the layout, the target-layer ids as that layout numbers them,
the block size and slot convention, the mask token and the Markov head. The engine facts are
``core.block_facts``'s; each finding says what the engine does (refuses, or loads and misreads), in its words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core import block_facts as bf
from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import TargetFiles


def is_block_dir(path: Path | None) -> bool:
    if path is None:
        return False
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and bf.kind_from_config(raw) is not None


def layout_of(raw: dict) -> str:
    """``speculators`` | ``deepspec`` | ``zlab`` (the readers' names; see stages/export/block_readers)."""
    if raw.get("speculators_model_type") in ("dflash", "dflash2", "dspark"):
        return "speculators"
    if any("DSpark" in str(a) for a in raw.get("architectures") or []) or "target_layer_ids" in raw:
        return "deepspec"
    return "zlab"


def layer_ids(raw: dict, layout: str) -> tuple[list[int] | None, str]:
    """draftsmith-numbered ids and the evidence line that says where they came from (None: not stated)."""
    if layout == "speculators":
        ids = raw.get("aux_hidden_state_layer_ids")
        return ([int(i) for i in ids] if ids else None), f"aux_hidden_state_layer_ids = {ids} (input of layer L)"
    d = raw.get("dflash_config") or {}
    for where, ids in (("dflash_config.target_layer_ids", d.get("target_layer_ids")),
                       ("target_layer_ids", raw.get("target_layer_ids")),
                       ("dspark_target_layer_ids", raw.get("dspark_target_layer_ids"))):
        if ids:
            return bf.from_output_layer_ids(ids), f"{where} = {list(ids)} (output of layer i = draftsmith i+1)"
    return None, "no target_layer_ids"


@dataclass(frozen=True)
class TargetShape:
    """What the block checks read of a target, from a model directory or a GGUF alike."""

    num_layers: int | None
    vocab_size: int | None  # embedding rows
    tokenizer_size: int | None

    @classmethod
    def of(cls, t: TargetFiles | None) -> TargetShape:
        if t is None:
            return cls(None, None, None)
        ints = [v if isinstance(v, int) else None for v in (t.num_layers, t.vocab_size)]
        return cls(*ints, t.tokenizer_size)


def check_block_drafter(out: Findings, engine: str, t: TargetShape, drafter: Path,
                        num_speculative_tokens: int | None = None, *, engine_version: str | None = None,
                        on_cpu: bool = True) -> None:
    """Every block-drafter finding for ``engine`` (vllm, sglang, llamacpp, draftsmith)."""
    raw = json.loads((drafter / "config.json").read_text())
    kind = bf.kind_from_config(raw)
    layout = layout_of(raw)
    slot = bf.slot_from_config(raw, layout)
    q = raw.get("transformer_layer_config") if layout == "speculators" else raw
    q = q if isinstance(q, dict) else {}
    d = raw.get("dflash_config") or {}
    block = raw.get("block_size", d.get("block_size", raw.get("dspark_block_size")))
    mask = d.get("mask_token_id", raw.get("mask_token_id", raw.get("dspark_noise_token_id")))
    ids, ids_evidence = layer_ids(raw, layout)
    head = raw.get("markov_head_type") if kind == "dspark" else None
    if num_speculative_tokens is None and layout == "speculators":
        methods = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        num_speculative_tokens = methods[0].get("speculative_tokens")
    out.facts.update(block_kind=kind, block_layout=layout, block_slot=slot, block_size=block,
                     block_layer_ids=ids, mask_token_id=mask, markov_head_type=head,
                     drafter_format=f"{kind} {layout}", aux_layer_ids=ids,
                     draft_vocab_size=raw.get("draft_vocab_size") or q.get("vocab_size"))
    ev = f"{drafter}/config.json"
    out.add("block.layout", "info", f"a {kind} drafter in {layout}'s layout, blocks {slot.replace('_', '-')}"
            + (f", {bf.drafts_per_block(block, slot)} drafts per block of {block}"
               if isinstance(block, int) and block > 0 else ""),
            f"{ev}: {ids_evidence}")
    if block is None:
        out.add("block.size", "error", "the config gives no block_size", ev, "add block_size to config.json")
    elif problem := bf.block_size_problem(block):
        out.add("block.size", "error", problem, f"{ev}: block_size = {block!r}", "retrain, or correct config.json")
        block = None  # the engine facts below read a usable size only
    if kind == "dflash" and (markov := [n for n in _weight_names(drafter) if "markov" in n]):
        out.add("block.kind", "error", f"labelled dflash, but its weights hold a DSpark Markov head ({markov[0]}, "
                "...): an engine builds a DFlash drafter from the label and refuses those tensors or drops the head, "
                "and the slot convention it reads follows the wrong kind", ev,
                "label it dspark (architectures Qwen3DSparkModel, or draftsmith export from the run)")
        return
    _check_layers(out, t, ids, ids_evidence, ev, engine)
    _check_mask(out, t, mask, raw, kind, engine, ev)
    if engine == "llamacpp":
        _check_llamacpp_width(out, q, raw, ev)
    if engine == "vllm" and engine_version and engine_version.split(".")[:2] != ["0", "32"]:
        out.add("block.version", "warning", f"block-drafter facts are read from vLLM 0.32; {engine_version} may "
                "read other keys or lack DFlash/DSpark", ev, "check with vLLM 0.32, or install yours and rerun")
    if engine in bf.BLOCK_ENGINES and kind is not None and block is not None:
        vocab = q.get("vocab_size") or raw.get("vocab_size")
        full = raw.get("draft_vocab_size") in (None, vocab)
        for f in bf.engine_findings(engine, kind=kind, slot=slot, layout=layout, raw=raw, block_size=int(block),
                                    markov_head_type=head, draft_vocab_full=full,
                                    num_speculative_tokens=num_speculative_tokens, on_cpu=on_cpu):
            out.add(f.id, f.severity, f.message, ev, f.fix, engine_fact=True)


def _weight_names(drafter: Path) -> list[str]:
    """The tensor names in the drafter's safetensors headers (none where they cannot be read)."""
    from draftsmith.core.tensorfile import read_checkpoint_headers

    try:
        return sorted(read_checkpoint_headers(drafter)[0])
    except (OSError, ValueError, KeyError):
        return []


def check_block_weights(out: Findings, drafter: Path) -> None:
    """The weights' headers against the file sizes: a truncated model.safetensors fails at load in every engine
    (the config-only checks above cannot see it). A folder without weights (a metadata-only download) says nothing."""
    from draftsmith.core.tensorfile import damaged_files

    if bad := damaged_files(drafter):
        out.add("block.weights", "error", f"the drafter's weights cannot be loaded: {'; '.join(bad[:3])}",
                str(drafter), "copy the drafter again, or re-export it (a download or copy was cut short)")


def _check_layers(out: Findings, t: TargetShape, ids: list[int] | None, evidence: str, ev: str,
                  engine: str) -> None:
    if ids is None:
        out.add("block.layers", "warning", "the config lists no target layers: engines fall back to their own "
                "defaults (z-lab's build_target_layer_ids), which may not be the layers it was trained on",
                ev, "state target_layer_ids (draftsmith export does)")
        return
    n = t.num_layers
    if ids != sorted(set(ids)):
        out.add("block.layers", "error" if engine == "vllm" else "warning",
                f"target layers {ids} are not strictly increasing: vLLM concatenates the target's states in layer "
                "order whatever the config lists, so fc reads its inputs permuted (DeepSpec requires increasing ids)",
                f"{ev}: {evidence}", "retrain with increasing ids")
    if n is not None and any(not 0 <= i < n for i in ids):
        out.add("block.layers", "error", f"target layers {ids} (draftsmith numbering) fall outside the target's "
                f"{n} layers: vLLM stops with \"DFlash drafter expects ... concatenated aux hidden features\", "
                "llama.cpp aborts (\"target layer ... input not extracted\")", f"{ev}: {evidence}",
                "pair the drafter with the target it was trained on")
    elif engine == "sglang" and any(i < 1 for i in ids):
        out.add("block.layers", "error", "layer 0 (the embedding output) cannot be listed in SGLang's "
                "output-of-layer numbering (its ids must be >= 0 after subtracting one)", f"{ev}: {evidence}")


def _check_mask(out: Findings, t: TargetShape, mask, raw: dict, kind: str | None, engine: str,
                ev: str) -> None:
    rows, tok = t.vocab_size, t.tokenizer_size
    if mask is None and engine == "sglang" and kind == "dflash":
        mask_name = (raw.get("dflash_config") or {}).get("mask_token") or bf.DEFAULT_MASK_TOKEN
        out.add("block.mask", "warning", f"no mask_token_id: SGLang's DFlash looks up the token {mask_name!r} in the "
                "target's tokenizer, which must hold it", ev, "state dflash_config.mask_token_id")
        return
    problem = bf.mask_token_problem(None if mask is None else int(mask), rows, tok)
    if problem:
        out.add("block.mask", "error", problem, f"{ev}: mask_token_id = {mask}; target vocab_size = {rows}",
                "train with a mask id inside the target's vocabulary")
        return
    out.add("block.mask", "info", bf.mask_token_note(int(mask), tok), f"{ev}: mask_token_id = {mask}")


def _check_llamacpp_width(out: Findings, q: dict, raw: dict, ev: str) -> None:
    width, target = q.get("hidden_size"), raw.get("target_hidden_size")
    if width is not None and target is not None and int(width) != int(target):
        out.add("block.width", "error", f"llama.cpp sizes fc's input as target layers x the drafter's width "
                f"({width}), but the target's states are {target} wide: the drafter cannot load there",
                f"{ev}: hidden_size = {width}, target_hidden_size = {target}",
                "train a drafter as wide as the target for llama.cpp")


def check_block_gguf(out: Findings, t: TargetShape, target_hidden: int | None, path: Path) -> None:
    """A ``dflash`` GGUF against the target llama.cpp serves: layers, width, mask token, and which --spec-type
    reads its blocks as trained (the DFlash type always fills in; the DSpark type reads sample_from_anchor)."""
    from draftsmith.core.gguf_file import open_gguf

    reader = open_gguf(path)
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith(("dflash.", "tokenizer.ggml.mask"))}
    tensors = {x.name: [int(n) for n in x.shape] for x in reader.tensors}
    ev = f"{path}: dflash.*"
    ids = f.get("dflash.target_layers")
    kind = "dspark" if "markov_w1.weight" in tensors else "dflash"
    anchor_first = f.get("dflash.sample_from_anchor", True)
    slot = bf.ANCHOR_FIRST if anchor_first else bf.FILL_IN
    out.facts.update(block_kind=kind, block_layout="gguf", block_slot=slot, block_layer_ids=ids,
                     block_size=f.get("dflash.block_size"), mask_token_id=f.get("tokenizer.ggml.mask_token_id"),
                     drafter_format=f"{kind} gguf", aux_layer_ids=ids)
    if f.get("dflash.block_size") is not None and (problem := bf.block_size_problem(f["dflash.block_size"])):
        out.add("block.size", "error", problem, f"{path}: dflash.block_size", "export with draftsmith export")
    if not ids:
        out.add("block.layers", "error", "no dflash.target_layers: llama.cpp refuses the drafter (\"DFlash model "
                "requires 'target_layers' in GGUF metadata\")", ev, "export with draftsmith export --format gguf")
    elif t.num_layers is not None and any(not 0 <= int(i) < t.num_layers for i in ids):
        out.add("block.layers", "error", f"target layers {list(ids)} (input of layer L) fall outside the target's "
                f"{t.num_layers} layers: llama.cpp aborts (\"target layer ... input not extracted\")", ev)
    width = f.get("dflash.embedding_length")
    if width is not None and target_hidden is not None and int(width) != int(target_hidden):
        out.add("block.width", "error", f"the drafter is {width} wide, the target {target_hidden}: llama.cpp sizes "
                "fc's input from the drafter's width and cannot load it", ev)
    problem = bf.mask_token_problem(f.get("tokenizer.ggml.mask_token_id"), t.vocab_size, None)
    if problem:
        out.add("block.mask", "error", problem + " (llama.cpp fills DFlash blocks with tokenizer.ggml.mask_token_id)",
                ev, "export with draftsmith export --format gguf")
    served = f"--spec-type draft-{kind}"
    if kind == "dflash" and slot == bf.ANCHOR_FIRST:
        out.add("block.slot", "error", "an anchor-first drafter without a Markov head: llama.cpp's DFlash type fills "
                "in and would read every draft one position off (~1.1 tokens a round, no error)", ev)
    else:
        out.add("block.slot", "info", f"serve with {served}: it reads these blocks {slot.replace('_', '-')}, as "
                "trained", ev)
