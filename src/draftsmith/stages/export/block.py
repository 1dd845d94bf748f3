"""Block drafters (DFlash, DSpark) in the engines' layouts: one canonical checkpoint, its writers and its readers.

Canonical tensor names are the ones vLLM 0.32, DeepSpec and speculators share (no ``model.`` prefix):
``fc.weight`` [H, n_aux * target_H], ``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.*`` (a Qwen3 layer:
``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``input_layernorm``, ``post_attention_layernorm``,
``mlp.{gate,up,down}_proj``), optional ``lm_head.weight`` [Vd, H], ``embed_tokens.weight``, ``d2t`` (int64
offsets, target id = i + d2t[i]) and ``t2d``; DSpark adds ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [Vd, r] (plus ``markov_head.gate_proj.*`` for a gated head, ``joint_proj.*`` for
an rnn one) and ``confidence_head.proj.{weight,bias}``.

Layouts written (``/work/wt/notes/block-engines.md`` has the sources):
  * ``vllm``: the HF layout vLLM 0.32 loads (``DFlashDraftModel`` with ``dflash_config``; ``Qwen3DSparkModel``
    with top-level DSpark keys). Layer ids in output-of-layer numbering; ``sample_from_anchor`` always explicit.
  * ``speculators``: speculators 0.9's config (``aux_hidden_state_layer_ids`` in draftsmith numbering).
  * ``sglang``: DeepSpec's layout (SGLang's DSPARK/DFLASH read it): no speculators keys, anchor-first DSpark.
Readers take those, z-lab's and DeepSpec's released layouts, and speculators', into the canonical form.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith import __version__
from draftsmith.core import block_facts as bf
from draftsmith.core.conventions import ConventionError
from draftsmith.core.layouts import MANIFEST_FILE, WEIGHTS_FILE
from draftsmith.stages.export.checkpoint import check_finite

BLOCK_FORMATS = ("vllm", "speculators", "sglang")
BLOCK_IMPORT_FORMATS = ("zlab", "deepspec", "speculators", "vllm", "sglang")
ExportError = ConventionError
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class BlockSpec:
    """A block drafter's shape and conventions; layer ids in draftsmith numbering (input of layer L)."""

    kind: str
    block_size: int
    aux_layer_ids: tuple[int, ...]
    mask_token_id: int
    slot: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's embedding rows (input vocabulary)
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 4096
    markov_rank: int = 0
    markov_head_type: str | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False
    num_target_layers: int | None = None
    target: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in bf.KINDS:
            raise ExportError(f"unknown block drafter kind {self.kind!r}; one of {', '.join(bf.KINDS)}")
        bf.check_slot(self.slot)
        if problem := bf.block_size_problem(self.block_size):
            raise ExportError(f"{problem}; retrain, or correct the drafter's config.json")
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.kind == "dspark" and self.markov_rank > 0 and self.markov_head_type not in bf.MARKOV_TYPES:
            raise ExportError(f"unknown Markov head type {self.markov_head_type!r}; one of {bf.MARKOV_TYPES}")

    @property
    def drafts(self) -> int:
        return bf.drafts_per_block(self.block_size, self.slot)


@dataclass
class BlockCheckpoint:
    spec: BlockSpec
    state: dict[str, torch.Tensor]
    source: str = "<in memory>"
    source_format: str = "draftsmith"
    warnings: list[str] = field(default_factory=list)

    def validate(self) -> BlockCheckpoint:
        """Check every tensor's shape against the spec (one clear line for the first that disagrees)."""
        want = expected_shapes(self.spec, self.state)
        missing = sorted(set(want) - set(self.state))
        if missing:
            raise ExportError(f"{self.source}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        extra = sorted(set(self.state) - set(want))
        if self.spec.kind == "dflash" and any("markov" in n for n in extra):
            raise ExportError(f"{self.source}: labelled dflash, but it holds a DSpark Markov head "
                              f"({next(n for n in extra if 'markov' in n)}): label it dspark (architectures "
                              "Qwen3DSparkModel)")
        if extra:
            raise ExportError(f"{self.source}: tensors with no place in a {self.spec.kind} drafter: {extra[:4]}")
        for name, shape in want.items():
            got = tuple(self.state[name].shape)
            if got != shape:
                raise ExportError(f"{self.source}: {name} has shape {got}, the config says {shape}")
        check_finite(self.state, self.source)
        return self


def expected_shapes(s: BlockSpec, state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter of this spec holds (optional ones only when ``state`` has them)."""
    h, d, f = s.hidden_size, s.head_dim, s.intermediate_size
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(s.aux_layer_ids) * s.target_hidden_size), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(s.num_hidden_layers):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (s.num_attention_heads * d, h),
                p + "self_attn.k_proj.weight": (s.num_key_value_heads * d, h),
                p + "self_attn.v_proj.weight": (s.num_key_value_heads * d, h),
                p + "self_attn.o_proj.weight": (h, s.num_attention_heads * d),
                p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f)}
    optional = {"lm_head.weight": (s.draft_vocab_size, h), "embed_tokens.weight": (s.vocab_size, h),
                "d2t": (s.draft_vocab_size,), "t2d": (s.vocab_size,)}
    out |= {k: v for k, v in optional.items() if k in state}
    r = s.markov_rank
    if s.kind == "dspark" and r > 0:
        out |= {"markov_head.markov_w1.weight": (s.vocab_size, r),
                "markov_head.markov_w2.weight": (s.draft_vocab_size, r)}
        if s.markov_head_type == "gated":
            out |= {"markov_head.gate_proj.weight": (r, h + r), "markov_head.gate_proj.bias": (r,)}
        elif s.markov_head_type == "rnn":
            out |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + h), "markov_head.joint_proj.bias": (3 * r,)}
    if s.confidence_head:
        out |= {"confidence_head.proj.weight": (1, h + (r if s.confidence_with_markov else 0)),
                "confidence_head.proj.bias": (1,)}
    return out


# --- writers -------------------------------------------------------------------------------------------------
@dataclass
class BlockExportReport:
    format: str
    path: Path
    kind: str
    weights: list[str]
    dtype: str
    aux_layer_ids: list[int]
    layout_layer_ids: list[int]  # as the layout's config lists them
    slot: str
    num_speculative_tokens: int
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"exported {self.format} {self.kind} drafter to {self.path} ({len(self.weights)} tensors, "
                 f"{self.dtype})",
                 f"target layers: {self.aux_layer_ids} (input of layer L), {self.layout_layer_ids} in the layout's "
                 "config", f"blocks: {self.slot.replace('_', '-')}, {self.num_speculative_tokens} drafts a round"]
        if self.format == "vllm":
            spec = {"method": self.kind, "model": str(Path(self.path).resolve()),
                    "num_speculative_tokens": self.num_speculative_tokens}
            lines.append(f"serve: vllm serve TARGET --speculative-config '{json.dumps(spec)}'")
        elif self.format == "sglang":
            algo = self.kind.upper()
            lines.append(f"serve: python -m sglang.launch_server --model-path TARGET --speculative-algorithm {algo} "
                         f"--speculative-draft-model-path {self.path} "
                         f"--speculative-num-draft-tokens {self.num_speculative_tokens + 1}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}


def export_block(ckpt: BlockCheckpoint, out: str | Path, fmt: str, *, dtype: str = "bf16",
                 verifier: str | None = None, verifier_architectures: list[str] | None = None,
                 overwrite: bool = False, card: dict | None = None) -> BlockExportReport:
    """Write ``ckpt`` in an engine's layout; refuses (before writing) what that engine would misread. The model card
    (README.md + drafter_card.json; ``card``: extra facts such as license, bench_reports, repo_id, base_model) is
    written with the weights and swapped in with them."""
    if fmt not in BLOCK_FORMATS:
        raise ExportError(f"unknown block export format {fmt!r}; choose one of {', '.join(BLOCK_FORMATS)}")
    if dtype not in _DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    ckpt.validate()
    s = ckpt.spec
    check_layout(s, fmt)
    if fmt == "speculators" and not verifier:
        raise ExportError("the speculators layout names its verifier: pass --verifier (the target's id or directory)")
    notes = list(ckpt.warnings)
    config = {"vllm": _vllm_config, "sglang": _deepspec_config}[fmt](s) if fmt != "speculators" else \
        _speculators_config(s, verifier, verifier_architectures or [])
    state = _layout_state(ckpt, fmt, notes)
    target_dtype = _DTYPES[dtype]
    state = {k: v.to(torch.int64 if k == "d2t" else torch.bool if k == "t2d" else target_dtype).contiguous()
             for k, v in state.items()}
    config["dtype" if fmt != "sglang" else "torch_dtype"] = str(target_dtype).removeprefix("torch.")
    ids = list(s.aux_layer_ids)
    layout_ids = ids if fmt == "speculators" else bf.to_output_layer_ids(ids)
    manifest = {"format": fmt, "kind": s.kind, "draftsmith_version": __version__, "source": ckpt.source,
                "source_format": ckpt.source_format, "aux_layer_ids": ids,
                "aux_layer_ids_convention": "input of layer L (draftsmith, vLLM aux, speculators, llama.cpp)",
                "layout_layer_ids": layout_ids, "slot": s.slot, "block_size": s.block_size,
                "mask_token_id": s.mask_token_id, "target": s.target, "weights": sorted(state)}
    facts = _card_facts(ckpt, fmt, Path(out), verifier, sorted(["config.json", WEIGHTS_FILE, MANIFEST_FILE]), card)
    _write(Path(out), config, state, manifest, overwrite, facts)
    return BlockExportReport(format=fmt, path=Path(out), kind=s.kind, weights=sorted(state),
                             dtype=str(target_dtype).removeprefix("torch."), aux_layer_ids=ids,
                             layout_layer_ids=layout_ids, slot=s.slot, num_speculative_tokens=s.drafts,
                             warnings=notes)


def check_layout(s: BlockSpec, fmt: str) -> None:
    """Refuse a drafter the layout's engine would load and misread (the silent failures of block drafters)."""
    engine = "sglang" if fmt == "sglang" else "vllm"
    reads = bf.engine_reads_slot(engine, s.kind, fmt, {"sample_from_anchor": s.slot == bf.ANCHOR_FIRST})
    if reads != s.slot:
        raise ExportError(f"{engine}'s {s.kind} reads blocks {reads.replace('_', '-')}, this drafter was trained "
                          f"{s.slot.replace('_', '-')}: it would load and draft every token one position off. "
                          + ("Train it fill-in for this engine" if s.kind == "dflash" else
                             "Serve it in vLLM or llama.cpp, which read both conventions"))
    e = bf.BLOCK_ENGINES[engine]
    if s.kind == "dspark" and s.markov_rank > 0 and s.markov_head_type not in e.markov_types:
        raise ExportError(f"{e.name} computes only {sorted(e.markov_types)} Markov heads; this drafter's is "
                          f"{s.markov_head_type!r} (its head would not be applied)")
    if not e.own_lm_head and s.draft_vocab_size != s.vocab_size:
        raise ExportError(f"{e.name} scores drafts with the target's lm_head and skips the drafter's d2t: a draft "
                          f"vocabulary of {s.draft_vocab_size} (target {s.vocab_size}) cannot be served there")
    if s.draft_vocab_size > s.vocab_size:
        raise ExportError(f"draft vocabulary {s.draft_vocab_size} exceeds the target's {s.vocab_size}")
    if fmt != "speculators":
        bf.to_output_layer_ids(s.aux_layer_ids)  # refuses layer 0, which output-of-layer numbering cannot say
    ids = list(s.aux_layer_ids)
    n = s.num_target_layers  # from the drafter's target fingerprint, where it has one
    if n is not None and any(not 0 <= i < n for i in ids):
        raise ExportError(f"target layers {ids} (input of layer L) fall outside the target's {n} layers (the "
                          "drafter's target fingerprint): every engine would refuse it or read other states")
    if problem := bf.mask_token_problem(s.mask_token_id, s.vocab_size, None):
        raise ExportError(problem)
    if ids != sorted(set(ids)):
        raise ExportError(f"target layers {ids} are not strictly increasing: vLLM concatenates the target's states "
                          "in layer order whatever the config lists, so fc would read its inputs permuted")


def _qwen3_fields(s: BlockSpec) -> dict:
    """The Qwen3 decoder fields every layout's draft config shares (vLLM builds Qwen3 layers from them)."""
    return {
        "model_type": "qwen3", "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "rms_norm_eps": s.rms_norm_eps, "rope_theta": s.rope_theta,
        # transformers 5 (vLLM 0.32's) reads rope_parameters; 4.x (SGLang's) the top-level rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": s.rope_theta},
        "max_position_embeddings": s.max_position_embeddings,
        "vocab_size": s.vocab_size, "tie_word_embeddings": False, "attention_bias": False,
        "layer_types": ["full_attention"] * s.num_hidden_layers,
    }


def _dspark_fields(s: BlockSpec) -> dict:
    return {"markov_rank": s.markov_rank, "markov_head_type": s.markov_head_type or "vanilla",
            "enable_confidence_head": s.confidence_head, "confidence_head_with_markov": s.confidence_with_markov}


def _vllm_config(s: BlockSpec) -> dict:
    ids = bf.to_output_layer_ids(s.aux_layer_ids)
    base = {**_qwen3_fields(s), "block_size": s.block_size, "draft_vocab_size": s.draft_vocab_size,
            "target_hidden_size": s.target_hidden_size, "num_target_layers": s.num_target_layers}
    if s.kind == "dflash":
        return {"architectures": ["DFlashDraftModel"], **base,
                "dflash_config": {"mask_token_id": s.mask_token_id, "target_layer_ids": ids, "causal": False}}
    return {"architectures": ["Qwen3DSparkModel"], **base, "target_layer_ids": ids, "mask_token_id": s.mask_token_id,
            "sample_from_anchor": s.slot == bf.ANCHOR_FIRST, **_dspark_fields(s)}


def _deepspec_config(s: BlockSpec) -> dict:
    """DeepSpec's layout (what SGLang's DSPARK and DFLASH read): output-of-layer ids, no speculators keys."""
    ids = bf.to_output_layer_ids(s.aux_layer_ids)
    base = {**_qwen3_fields(s), "block_size": s.block_size, "num_target_layers": s.num_target_layers,
            "target_layer_ids": ids, "mask_token_id": s.mask_token_id}
    if s.kind == "dflash":
        return {"architectures": ["DFlashDraftModel"], **base,
                "dflash_config": {"mask_token_id": s.mask_token_id, "target_layer_ids": ids, "block_size": s.block_size,
                                  "num_target_layers": s.num_target_layers}}
    return {"architectures": ["Qwen3DSparkModel"], **base, **_dspark_fields(s)}


def _speculators_config(s: BlockSpec, verifier: str, archs: list[str]) -> dict:
    d = {
        "architectures": ["DFlashSpeculator" if s.kind == "dflash" else "DSparkSpeculator"],
        "speculators_model_type": s.kind, "transformer_layer_config": _qwen3_fields(s),
        "draft_vocab_size": s.draft_vocab_size, "block_size": s.block_size, "target_hidden_size": s.target_hidden_size,
        "aux_hidden_state_layer_ids": list(s.aux_layer_ids), "mask_token_id": s.mask_token_id,
        "sliding_window_non_causal": False,
        # Explicit: speculators' default differs per kind, and vLLM's reader takes an absent one as false.
        "sample_from_anchor": s.slot == bf.ANCHOR_FIRST,
        "speculators_config": {"algorithm": s.kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": s.drafts}],
                               "verifier": {"name_or_path": verifier, "architectures": list(archs)}},
        "speculators_version": "0.9.0",
    }
    if s.kind == "dspark":
        d |= _dspark_fields(s)
    return d


def _layout_state(ckpt: BlockCheckpoint, fmt: str, notes: list[str]) -> dict[str, torch.Tensor]:
    """The tensors under the layout's names: d2t only for a reduced vocabulary (vLLM has no place for it
    otherwise), t2d only for speculators (its loader slices the verifier's head with it)."""
    s = ckpt.spec
    state = dict(ckpt.state)
    if s.draft_vocab_size == s.vocab_size or fmt != "speculators":
        state.pop("t2d", None)
    if s.draft_vocab_size == s.vocab_size:
        state.pop("d2t", None)
    elif "d2t" not in state or "lm_head.weight" not in state:
        raise ExportError("a reduced draft vocabulary needs its d2t and lm_head tensors")
    if fmt == "sglang" and "lm_head.weight" in state:
        notes.append("SGLang scores drafts with the target's lm_head and skips the drafter's lm_head.weight: "
                     "serve it there only if the drafter's head is the target's (DeepSpec freezes it so)")
    return state


def _card_facts(ckpt: BlockCheckpoint, fmt: str, out: Path, verifier: str | None, files: list[str],
                card: dict | None, target_gguf: str | None = None) -> dict:
    from draftsmith.stages.export.block_card import block_card_facts
    from draftsmith.stages.export.card import base_model_of

    extra = dict(card or {})
    base = extra.pop("base_model", None) or base_model_of(verifier)
    source = ckpt.source if Path(ckpt.source).is_dir() else None
    return block_card_facts(spec=ckpt.spec, fmt=fmt, out=out, source=source, base_model=base, files=files,
                            d2t=ckpt.state.get("d2t"), target_gguf=target_gguf, **extra)


def _write(out: Path, config: dict, state: dict[str, torch.Tensor], manifest: dict, overwrite: bool,
           card: dict | None = None) -> None:
    """The EAGLE-3 exports' staged write (writers._write): swapped in whole, a user's README.md kept."""
    from draftsmith.stages.export.writers import _write as write_staged

    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory; the export writes a directory")
    write_staged(out, config, state, manifest, overwrite, card)
