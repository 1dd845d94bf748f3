"""Write a drafter as the EAGLE-3 GGUF llama.cpp loads (``--model-draft`` / ``speculative.draft.mparams.path``).

The layout (checked against xllamacpp 2026.10.11549 and llama.cpp's ``src/models/eagle3.cpp``): architecture
``eagle3``; keys ``eagle3.target_layers`` (3 aux ids, input-of-layer numbering), ``eagle3.target_hidden_size``,
``eagle3.norm_before_residual``; tensors ``fc``, ``blk.0.attn_norm`` (embedding norm), ``blk.0.attn_norm_2`` (the
hidden-state norm), ``blk.0.attn_{q,k,v}`` of input width 2H, ``blk.0.attn_output``, ``blk.0.ffn_{norm,gate,up,down}``,
``output_norm``, ``output`` (the draft-vocabulary head) and ``d2t``: I64 *absolute* target ids, which the engine
scatters the draft logits onto (draftsmith's ``d2t`` holds offsets). The token embedding is shared with the target
unless the drafter has its own. q and k rows are permuted from Hugging Face's rotate-half order into the
interleaved pairs llama.cpp's rope rotates. The draft GGUF carries the target's tokenizer: llama.cpp sizes the
full-vocabulary logits it scatters into from the draft model's own vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith import __version__
from draftsmith.core import llamacpp_facts as facts
from draftsmith.core.conventions import ConventionError, to_llamacpp_layer_ids
from draftsmith.core.gguf_file import GgufFileError, open_gguf
from draftsmith.model.drafter import Eagle3Drafter
from draftsmith.stages.export.checkpoint import DTYPES, DrafterCheckpoint, ExportError
from draftsmith.stages.export.readers import read_checkpoint

# draftsmith's canonical names -> llama.cpp's tensor names (the layer's are under blk.0.).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
              "embed_tokens.weight": "token_embd.weight"}


@dataclass
class TargetGguf:
    """What the export needs from the target's GGUF: its architecture, sizes, and tokenizer fields."""

    path: Path
    arch: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_fields: list  # gguf ReaderField, copied verbatim into the draft


@dataclass
class GgufExportReport:
    format: str
    path: Path
    tensors: list[str]
    dtype: str
    aux_layer_ids: list[int]  # draftsmith / vLLM / llama.cpp: input of target layer L
    target_arch: str
    target: str
    draft_vocab_size: int
    num_speculative_tokens: int = 3  # the serve line's --draft-max

    def summary(self) -> str:
        # Which k pays depends on the machine and the drafter (on CPUs a round's verify pass costs more than a
        # step), so the summary says how to measure it rather than guessing.
        bench = ["draftsmith", "bench", "--engine", "llamacpp", "--target", self.target, "--drafter",
                 str(self.path), "--draft-max", "1,2,3", "--prompt-lookup", "3"]
        return "\n".join([
            f"exported gguf drafter to {self.path} ({len(self.tensors)} tensors, {self.dtype}, arch eagle3)",
            f"aux layer ids: {self.aux_layer_ids} (input of layer L; llama.cpp's eagle3.target_layers)",
            f"serve: {shlex.join(llama_server_argv(self.target, str(self.path), self.num_speculative_tokens))}",
            f"which --draft-max pays here: {shlex.join(bench)}",
        ])

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}


def llama_server_argv(target: str, drafter: str, k: int = 3) -> list[str]:
    """llama.cpp's server command line for an EAGLE-3 drafter (chain of ``k`` draft tokens per round)."""
    return ["llama-server", "-m", target, "--model-draft", drafter, "--spec-type", "draft-eagle3",
            "--draft-max", str(k), "--draft-min", "0"]


def read_target_gguf(target: str | Path) -> TargetGguf:
    """The target GGUF's architecture, sizes and tokenizer; 'smollm2' names the embedded default's GGUF."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT, smollm2_gguf_path

    path = smollm2_gguf_path() if str(target) == EMBEDDED_DEFAULT else Path(target).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) != 1:
            raise ExportError(f"{target}: the gguf format needs the target's .gguf file (llama.cpp serves it and "
                              f"its tokenizer goes into the draft); found {len(found)} in that directory")
        path = found[0]
    if not path.is_file() or path.suffix != ".gguf":
        raise ExportError(f"{target}: the gguf format needs the target's .gguf file (llama.cpp serves it and its "
                          "tokenizer goes into the draft)")
    try:
        reader = open_gguf(path)
    except GgufFileError as e:
        raise ExportError(str(e)) from e

    def get(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = str(get("general.architecture"))
    tokens = get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ExportError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    return TargetGguf(
        path=path, arch=arch, num_layers=int(get(f"{arch}.block_count") or 0),
        hidden_size=int(get(f"{arch}.embedding_length") or 0), vocab_size=len(tokens),
        tokenizer_fields=[f for name, f in reader.fields.items() if name.startswith("tokenizer.")])


def check_servable(ckpt: DrafterCheckpoint, switches: dict, target: TargetGguf | None) -> list[int]:
    """Refuse what llama.cpp cannot serve (one line each); return the aux ids as llama.cpp reads them."""
    cfg = ckpt.config
    unread = facts.engine_unread_norms(switches)
    if unread:
        raise ExportError(f"the drafter uses {', '.join(n + '=true' for n in unread)}, which llama.cpp's EAGLE-3 "
                          "graph does not read (it would draft without them); train without them for llama.cpp")
    if not ckpt.aux_known:
        raise ExportError("the drafter does not say which target layers it reads; llama.cpp needs them "
                          "(re-import it with --aux-layers)")
    arch = target.arch if target is not None else facts.gguf_arch(
        None, (cfg.target or {}).get("architecture"))
    if facts.target_supported(arch) is False:
        raise ExportError(f"llama.cpp serves EAGLE-3 only for targets of architecture "
                          f"{', '.join(sorted(facts.TARGET_ARCHES))}; this target is {arch} (its graph exposes no "
                          "layer inputs: it would abort at the first decode)")
    try:
        ids = to_llamacpp_layer_ids(cfg.aux_layer_ids, target.num_layers if target else None)
    except ConventionError as e:
        raise ExportError(str(e)) from e
    if target is not None:
        if target.hidden_size != cfg.target_hidden_size:
            raise ExportError(f"{target.path}: hidden size {target.hidden_size}, the drafter was made for "
                              f"{cfg.target_hidden_size}")
        if target.vocab_size != cfg.vocab_size:
            raise ExportError(f"{target.path}: vocabulary of {target.vocab_size} tokens, the drafter's is "
                              f"{cfg.vocab_size}")
    return ids


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q/k projection from rotate-half order (x_i, x_{i+d/2}) to llama.cpp's interleaved pairs."""
    out, width = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, width).transpose(1, 2).reshape(out, width)


def gguf_tensors(ckpt: DrafterCheckpoint) -> dict[str, torch.Tensor]:
    """Every tensor under its llama.cpp name, q/k permuted, d2t as absolute target ids (t2d is not read)."""
    cfg = ckpt.config
    out = {}
    for name, t in ckpt.state.items():
        if name in ("d2t", "t2d"):
            continue
        if name.startswith("layers.0."):
            short = name.removeprefix("layers.0.")
            if short == "self_attn.q_proj.weight":
                t = permute_rope(t, cfg.num_attention_heads)
            elif short == "self_attn.k_proj.weight":
                t = permute_rope(t, cfg.num_key_value_heads)
            gguf_name = "blk.0." + _LAYER_NAMES[short] if short in _LAYER_NAMES else None
        else:
            gguf_name = _TOP_NAMES.get(name)
        if gguf_name is None:  # check_servable refuses what llama.cpp does not read; this is the backstop
            raise ExportError(f"the drafter's tensor {name} has no place in llama.cpp's EAGLE-3 graph")
        out[gguf_name] = t
    if cfg.draft_vocab_size != cfg.vocab_size:  # no d2t: the engine scores the whole vocabulary directly
        d2t = ckpt.state["d2t"].to(torch.int64)
        out["d2t"] = torch.arange(d2t.numel(), dtype=torch.int64) + d2t
    return out


# GGUF's dtypes: export's float ones, and Q8_0 (llama.cpp's 8-bit blocks: on a CPU its integer dot products run
# a drafter call faster than bf16, which CPUs without AVX-512 BF16 convert in software).
GGUF_DTYPES = (*DTYPES, "q8_0")
Q8_0_BLOCK = 32


def _array(name: str, t: torch.Tensor, dtype: torch.dtype | str):
    """(numpy array, raw GGML type or None): norms stay F32 (as llama.cpp's converters keep them); q8_0 quantizes
    every matrix whose rows split into its 32-weight blocks (the rest stay bf16)."""
    from gguf import GGMLQuantizationType

    if t.dtype == torch.int64:
        return t.numpy(), None
    if dtype == "q8_0":
        if t.dim() == 2 and t.shape[-1] % Q8_0_BLOCK == 0:
            from gguf.quants import quantize

            return quantize(t.detach().float().numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
        dtype = torch.bfloat16
    if t.dim() == 1 or dtype == torch.float32:
        return t.detach().float().numpy(), None
    if dtype == torch.float16:
        return t.detach().to(torch.float16).numpy(), None
    return t.detach().to(torch.bfloat16).view(torch.int16).numpy(), GGMLQuantizationType.BF16


def read_drafter(drafter: Eagle3Drafter | DrafterCheckpoint | str | Path) -> tuple[DrafterCheckpoint, dict]:
    """The checkpoint, validated, and its config switches (EAGLE-3.1 norms may live only in config.json); doctor
    --engine llamacpp reads a drafter directory through here too, so that it refuses what the export refuses."""
    switches: dict = {}
    if isinstance(drafter, Eagle3Drafter):
        ckpt = DrafterCheckpoint.from_drafter(drafter)
    else:
        ckpt = drafter if isinstance(drafter, DrafterCheckpoint) else read_checkpoint(drafter)
        if isinstance(drafter, (str, Path)) and (Path(drafter) / "config.json").is_file():
            try:
                switches = json.loads((Path(drafter) / "config.json").read_text())
            except (OSError, ValueError):
                switches = {}
        ckpt.build()  # validate shapes and d2t before writing anything
    for name in (*facts.READS_NORMS, *facts.UNREAD_NORMS):
        if getattr(ckpt.config, name, None):
            switches[name] = True
    return ckpt, switches


def export_gguf(drafter: Eagle3Drafter | DrafterCheckpoint | str | Path, out: str | Path, *,
                target: str | Path, dtype: str = "bf16", num_speculative_tokens: int | None = None,
                overwrite: bool = False, card: dict | None = None) -> GgufExportReport:
    """Write ``drafter`` as one EAGLE-3 GGUF file for llama.cpp; ``target`` is the target's GGUF (or 'smollm2').

    The model card (drafter_card.json and README.md, ``card``: its extra facts) goes beside the file; a README.md
    of the user's there is kept (``card.updated_readme``).
    """
    from gguf import GGUFWriter

    if dtype not in GGUF_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}")
    from draftsmith.stages.export.card import chain_k

    if num_speculative_tokens is not None:
        check_draft_max(num_speculative_tokens, "--num-speculative-tokens")
    num_speculative_tokens = chain_k(num_speculative_tokens, drafter, (card or {}).get("decoded"))
    ckpt, switches = read_drafter(drafter)
    tgt = read_target_gguf(target)
    ids = check_servable(ckpt, switches, tgt)
    out = gguf_out_path(out, drafter if isinstance(drafter, (str, Path)) else None, tgt.path, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = ckpt.config
    tensors = gguf_tensors(ckpt)
    tmp = out.with_name(f".{out.name}.tmp")
    w = GGUFWriter(tmp, facts.GGUF_ARCH)
    w.add_name("draftsmith EAGLE-3 drafter")
    w.add_string("general.source.draftsmith_version", __version__)
    w.add_block_count(1)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_array(facts.KEY_TARGET_LAYERS, ids)
    w.add_array(facts.KEY_TARGET_LAYERS_EARLY, ids)  # ignored by current builds, read by early ones
    w.add_uint32(facts.KEY_TARGET_HIDDEN_SIZE, cfg.target_hidden_size)
    w.add_bool(facts.KEY_NORM_BEFORE_RESIDUAL, bool(switches.get("norm_before_residual")))
    for field in tgt.tokenizer_fields:
        copy_field(w, field)
    for name, t in tensors.items():
        arr, raw = _array(name, t, DTYPES.get(dtype, dtype))
        w.add_tensor(name, arr, raw_dtype=raw)
    finish_gguf(w, tmp, out)
    _write_card(out, ckpt, drafter, target, tgt, num_speculative_tokens, card)
    return GgufExportReport(format="gguf", path=out, tensors=sorted(tensors), dtype=dtype, aux_layer_ids=ids,
                            target_arch=tgt.arch, target=str(tgt.path), draft_vocab_size=cfg.draft_vocab_size,
                            num_speculative_tokens=num_speculative_tokens)


def check_draft_max(k: int, flag: str) -> None:
    """llama.cpp's --draft-max, bounded as decode bounds --chain: past a few dozen tokens nothing is accepted, and a
    huge k only makes the engine allocate and loop for it."""
    from draftsmith.stages.decode import MAX_DRAFT_LENGTH

    if not 1 <= k <= MAX_DRAFT_LENGTH:
        raise ExportError(f"{flag} must be between 1 and {MAX_DRAFT_LENGTH} (acceptance dies out long before), "
                          f"got {k}")


def gguf_out_path(out: str | Path, source: str | Path | None, target: Path, overwrite: bool) -> Path:
    """Where the drafter GGUF goes: ``out`` (a .gguf) or ``out/drafter.gguf``; never the target, never inside the
    drafter's own directory, and with ``overwrite`` it replaces only another EAGLE-3 drafter GGUF."""
    out = Path(out).expanduser()
    if out.is_dir() or out.suffix != ".gguf":
        out = out / "drafter.gguf"
    blocker = next((p for p in out.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ExportError(f"{out}: {blocker} is not a directory")
    if out.resolve() == target.resolve() or (out.exists() and out.samefile(target)):
        raise ExportError(f"{out}: that is the target GGUF; the drafter goes in a file of its own")
    if source is not None and Path(source).is_dir() and out.resolve().is_relative_to(Path(source).resolve()):
        raise ExportError(f"{out}: inside the drafter's own directory {source}; write the export elsewhere")
    if out.exists():
        if not overwrite:
            raise ExportError(f"{out}: exists (pass --force to replace it)")
        arch = _gguf_arch(out)
        if arch not in (None, facts.GGUF_ARCH):
            raise ExportError(f"{out}: a GGUF of architecture {arch}, not an EAGLE-3 drafter; --force replaces only "
                              "a drafter GGUF")
    return out


def _gguf_arch(path: Path) -> str | None:
    """A GGUF's general.architecture (None: not a readable GGUF: a damaged export may be replaced)."""
    try:
        field = open_gguf(path).fields.get("general.architecture")
    except GgufFileError:
        return None
    return None if field is None else str(field.contents())


def _write_card(out: Path, ckpt: DrafterCheckpoint, drafter, target: str | Path, tgt: TargetGguf, k: int,
                card: dict | None) -> None:
    from draftsmith.stages.export.card import base_model_of, card_facts, shown_path, write_card

    folder = out.parent
    extra = dict(card or {})
    base = extra.pop("base_model", None) or base_model_of(target if str(target) == "smollm2" else None)
    source = drafter if isinstance(drafter, (str, Path)) else None
    line = shlex.join(llama_server_argv(shown_path(tgt.path), shown_path(out), k))
    write_card(folder, card_facts(fmt="gguf", out=out, drafter_config=ckpt.config, source=source, base_model=base,
                                  num_speculative_tokens=k, files=[out.name], target_gguf=shown_path(tgt.path),
                                  llama_line=line, d2t=ckpt.state.get("d2t"), **extra))


def finish_gguf(w, tmp: Path, out: Path) -> None:
    """Write a GGUFWriter's header, keys and tensors to ``tmp``, then move it to ``out``: a kill leaves no half file."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, out)


def copy_field(w, field, name: str | None = None) -> None:
    """Copy one key of another GGUF verbatim (type included), under ``name`` when given."""
    from gguf import GGUFValueType

    main = field.types[0]
    sub = {"sub_type": field.types[-1]} if main == GGUFValueType.ARRAY else {}
    w.add_key_value(name or field.name, field.contents(), main, **sub)
