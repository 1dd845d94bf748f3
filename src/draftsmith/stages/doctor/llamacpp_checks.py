"""``doctor --engine llamacpp``: what llama.cpp does with a target GGUF and an EAGLE-3 drafter, from the files.

The verdict names the engine's own outcome: an error finding means llama.cpp refuses the pair at load (drafter keys,
aux count, widths) or loads it and aborts at the first decode (a target architecture whose graph exposes no layer
inputs), or drafts with switches it never reads; no error means it loads and drafts. GGUFs are read by their
headers (a damaged one is a finding); a drafter directory is read as ``export --format gguf`` reads it, so that
what the export refuses is an error here too. Facts: core/llamacpp_facts.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftsmith.core import llamacpp_facts as facts
from draftsmith.core.conventions import norm_switches
from draftsmith.core.errors import one_line
from draftsmith.core.gguf_file import GgufFileError, open_gguf
from draftsmith.stages.doctor.hybrid_checks import check_aux_kinds, check_layer_kinds, ways_out
from draftsmith.stages.doctor.report import DoctorReport, DoctorUsageError, Findings


def diagnose_llamacpp(target: str | Path, drafter: str | Path | None = None) -> DoctorReport:
    """Check a target (a .gguf, 'smollm2', or a model directory) and drafter (.gguf or drafter directory)."""
    t0 = time.perf_counter()
    report = DoctorReport(target=str(target), drafter=str(drafter) if drafter else None, engine="llamacpp",
                          engine_version=_engine_version(), engine_profile=None, engine_source="n/a")
    out = Findings(report)
    try:
        tgt = _target_facts(target)
    except GgufFileError as e:  # a damaged file is a finding: llama.cpp fails to load it
        out.add("llamacpp.target-file", "error", f"llama.cpp cannot load the target: {e}", str(target),
                "pass the target's whole .gguf (download or convert it again)")
        tgt = {"arch": None, "num_layers": None, "hidden_size": None, "vocab_size": None, "tensors": None}
    else:
        if tgt.get("hf_config") is not None:
            tgt["kinds"] = check_layer_kinds(out, tgt["hf_config"])
        _check_target_arch(out, tgt)
        _check_target_tensors(out, tgt)
    out.facts.update(architecture=tgt["arch"], num_layers=tgt["num_layers"], hidden_size=tgt["hidden_size"],
                     vocab_size=tgt["vocab_size"])
    out.add("llamacpp.chain", "info", "llama.cpp drafts a chain only (--draft-max k tokens per round, no trees): "
            "draftsmith's tree numbers do not carry over; bench --engine llamacpp measures the chain",
            "llama.cpp common/speculative.cpp: draft-eagle3 is a chain drafter")
    if drafter is not None:
        try:
            _check_any_drafter(out, tgt, drafter)
        except GgufFileError as e:
            out.add("llamacpp.drafter-file", "error", f"llama.cpp cannot load the drafter: {e}", str(drafter),
                    "export it again with draftsmith export --format gguf")
    report.seconds = time.perf_counter() - t0
    return report


def _check_any_drafter(out: Findings, tgt: dict, drafter: str | Path) -> None:
    """EAGLE-3's checks or the block kinds' (DFlash / DSpark), as llama.cpp reads each."""
    if _is_block(drafter):
        from draftsmith.stages.doctor.block_checks import TargetShape, check_block_drafter, check_block_gguf

        if tgt["num_layers"] is None:  # the target is unreadable: already a finding
            return
        shape = TargetShape(tgt["num_layers"], tgt["vocab_size"], tgt["vocab_size"])
        p = Path(drafter).expanduser()
        if p.suffix == ".gguf":
            check_block_gguf(out, shape, tgt["hidden_size"], p)
        else:
            check_block_drafter(out, "llamacpp", shape, p)
        return
    d = _drafter_facts(drafter)
    out.facts.update(drafter_format=d["format"], aux_layer_ids=d["aux"], draft_vocab_size=d["draft_vocab"])
    _check_drafter(out, tgt, d)
    check_aux_kinds(out, tgt.get("kinds"), d["aux"], "llama.cpp")


def _is_block(drafter: str | Path) -> bool:
    from draftsmith.stages.doctor.block_checks import is_block_dir

    p = Path(drafter).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_fields(p, ("general.architecture",)).get("general.architecture") == "dflash"
    return is_block_dir(p)


def _engine_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"xllamacpp {version('xllamacpp')}"
    except PackageNotFoundError:
        return None


# --- reading -----------------------------------------------------------------------------------------------------
def _gguf_fields(path: Path, keys_prefix: tuple[str, ...]) -> dict:
    reader = open_gguf(path)
    fields = {k: f.contents() for k, f in reader.fields.items()
              if k.startswith(keys_prefix) and k != "tokenizer.ggml.tokens" and not k.startswith("tokenizer.ggml.m")}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    fields["_vocab"] = len(tokens.data) if tokens is not None else None
    fields["_tensors"] = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in reader.tensors}
    d2t = next((t for t in reader.tensors if t.name == "d2t" and t.tensor_type.name == "I64"), None)
    fields["_d2t_range"] = (int(d2t.data.min()), int(d2t.data.max())) if d2t is not None and d2t.data.size else None
    return fields


def _target_facts(target: str | Path) -> dict:
    from draftsmith.model.sources import EMBEDDED_DEFAULT, smollm2_gguf_path

    p = smollm2_gguf_path() if str(target) == EMBEDDED_DEFAULT else Path(target).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        f = _gguf_fields(p, ("general.", "llama.", "qwen", "gemma", "gpt-oss", "lfm2", "phi3", "smollm3",
                             "granitehybrid.", "nemotron_h.", "falcon-h1.", "jamba."))
        arch = str(f.get("general.architecture"))
        return {"source": f"{p.name}: general.architecture", "arch": arch, "path": p,
                "num_layers": f.get(f"{arch}.block_count"), "hidden_size": f.get(f"{arch}.embedding_length"),
                "vocab_size": f["_vocab"], "tensors": set(f["_tensors"])}
    if p.is_dir() and (p / "config.json").is_file():
        raw = json.loads((p / "config.json").read_text())
        text = raw.get("text_config") or raw
        mt = text.get("model_type") or raw.get("model_type")
        archs = raw.get("architectures") or [None]
        return {"source": f"config.json: model_type = {mt!r} (llama.cpp converts it to a GGUF)",
                "arch": facts.gguf_arch(mt, archs[0]), "hf_model_type": mt, "hf_arch": archs[0], "hf_config": text,
                "num_layers": text.get("num_hidden_layers"), "hidden_size": text.get("hidden_size"),
                "vocab_size": text.get("vocab_size"), "tensors": None}
    raise DoctorUsageError(f"{target}: llama.cpp serves a .gguf target; pass that file (or a model directory "
                           "with config.json)")


def _drafter_facts(drafter: str | Path) -> dict:
    p = Path(drafter).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        f = _gguf_fields(p, ("general.", "eagle3."))
        d2t = f["_tensors"].get("d2t")
        out = f["_tensors"].get("output.weight")
        return {"format": "gguf", "path": p, "arch": f.get("general.architecture"),
                "aux": f.get(facts.KEY_TARGET_LAYERS), "target_hidden": f.get(facts.KEY_TARGET_HIDDEN_SIZE),
                "switches": {"norm_before_residual": bool(f.get(facts.KEY_NORM_BEFORE_RESIDUAL))},
                "d2t_type": d2t[0] if d2t else None, "d2t_range": f["_d2t_range"],
                "output_rows": out[1][-1] if out else None, "tensors": set(f["_tensors"]),
                "draft_vocab": d2t[1][0] if d2t else (out[1][-1] if out else None), "vocab": f["_vocab"]}
    if p.is_dir() and (p / "config.json").is_file():
        return _drafter_dir_facts(p)
    if not p.exists():
        raise DoctorUsageError(f"{drafter}: no such drafter (a .gguf file or a drafter directory)")
    raise DoctorUsageError(f"{drafter}: not an EAGLE-3 drafter (.gguf file or drafter directory)")


def _drafter_dir_facts(p: Path) -> dict:
    """A drafter directory, read as export --format gguf reads it (bench --engine llamacpp exports it so): what
    the export refuses is a finding (``refused``), and the switches come from the same place as the export's."""
    from draftsmith.stages.export.gguf import read_drafter

    base = {"format": "draftsmith (export --format gguf writes llama.cpp's)", "path": p, "arch": facts.GGUF_ARCH,
            "d2t_type": "I64", "d2t_range": None, "output_rows": None, "tensors": None}
    try:
        ckpt, switches = read_drafter(p)
    except Exception as e:  # noqa: BLE001 - whatever the reader refuses, the export refuses: reported, not raised
        try:
            raw = json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}
        on = {**norm_switches(raw), "norm_before_residual": bool(raw.get("norm_before_residual"))}
        return {**base, "refused": one_line(e), "aux": None, "target_hidden": None, "switches": on,
                "draft_vocab": None, "vocab": None}
    cfg = ckpt.config
    return {**base, "refused": None, "aux": list(cfg.aux_layer_ids) if ckpt.aux_known and cfg.aux_layer_ids else None,
            "target_hidden": cfg.target_hidden_size, "switches": switches, "draft_vocab": cfg.draft_vocab_size,
            "vocab": cfg.vocab_size}


# --- checks ------------------------------------------------------------------------------------------------------
def _check_target_arch(out: Findings, t: dict) -> None:
    arch, ok = t["arch"], facts.target_supported(t["arch"])
    supported = ", ".join(sorted(facts.TARGET_ARCHES))
    recurrent = arch in facts.RECURRENT_ARCHES
    if ok:
        out.add("llamacpp.target-arch", "info", f"llama.cpp extracts EAGLE-3 layer inputs from {arch} targets"
                + (f" (for DFlash/DSpark too); {arch} keeps a recurrent state, so llama.cpp verifies a chain and a "
                   "tree shape is not servable there" if recurrent else ""), t["source"] + f" = {arch}")
    elif ok is False:
        fix = f"serve a target of architecture {supported}, or use vLLM/SGLang"
        if recurrent:
            fix = "; or ".join(ways_out(t.get("hf_arch"), t.get("hf_model_type"), besides="llamacpp"))
        out.add("llamacpp.target-arch", "error", f"llama.cpp's {arch} graph exposes no layer inputs: the pair loads, "
                "then aborts at the first decode (GGML_ASSERT \"layer input tensor is null\"), for EAGLE-3, DFlash and "
                "DSpark alike", t["source"] + f" = {arch}", fix)
    else:
        out.add("llamacpp.target-arch", "warning", f"cannot tell whether llama.cpp drafts for this target ({arch})",
                t["source"], f"llama.cpp's EAGLE-3 targets: {supported}")


def _check_drafter(out: Findings, t: dict, d: dict) -> None:
    where = str(d["path"])
    if d["arch"] != facts.GGUF_ARCH:
        out.add("llamacpp.drafter-arch", "error", f"the drafter GGUF is architecture {d['arch']!r}, not eagle3",
                f"{where}: general.architecture", "export it with draftsmith export --format gguf")
        return
    if d.get("refused"):
        out.add("llamacpp.export", "error", f"export --format gguf refuses this drafter, so llama.cpp never gets it "
                f"(bench --engine llamacpp exports it the same way): {d['refused']}", f"{where}",
                "fix what the message names, or export the drafter from its training checkpoint")
        _check_norms(out, d)
        return
    aux = d["aux"]
    if aux is None:
        out.add("llamacpp.aux-layers", "error", "the drafter names no target layers: llama.cpp refuses it at load "
                "(\"EAGLE3 model requires 'extract_layers'\")", f"{where}: no {facts.KEY_TARGET_LAYERS}",
                "re-import with --aux-layers, then export --format gguf")
    elif len(aux) != facts.N_AUX:
        out.add("llamacpp.aux-layers", "error", f"{len(aux)} aux layers: llama.cpp refuses it at load (\"EAGLE3 "
                "requires exactly 3 entries\")", f"{where}: aux layers {aux}", "train with 3 aux layers")
    elif not facts.aux_ids_in_range(aux, t["num_layers"]):
        out.add("llamacpp.aux-layers", "error", f"aux layer ids {aux} exceed the target's {t['num_layers']} layers: "
                "llama.cpp refuses the pair", f"{where}: aux layers {aux}", "use a drafter made for this target")
    else:
        out.add("llamacpp.aux-convention", "info", f"aux ids {aux} name the input of each target layer (HF "
                "hidden_states[L]); llama.cpp reads them the same way: no shift", f"{where}: aux layers {aux}")
    if t["hidden_size"] and d["target_hidden"] and int(d["target_hidden"]) != int(t["hidden_size"]):
        out.add("llamacpp.width", "error", f"the drafter reads target states of width {d['target_hidden']}, the "
                f"target's are {t['hidden_size']}", f"{where}: target_hidden_size", "use a drafter for this target")
    if t["vocab_size"] and d["vocab"] and int(d["vocab"]) != int(t["vocab_size"]):
        out.add("llamacpp.vocab", "error", f"the drafter's vocabulary ({d['vocab']}) is not the target's "
                f"({t['vocab_size']})", f"{where}: tokenizer / vocab_size", "use a drafter for this target")
    if d["d2t_type"] not in (None, "I64"):
        out.add("llamacpp.d2t", "error", f"d2t is {d['d2t_type']}: llama.cpp asserts I64 at the first draft",
                f"{where}: tensor d2t", "re-export with draftsmith export --format gguf")
    vocab = t["vocab_size"] or d["vocab"]
    lo_hi = d["d2t_range"]
    if lo_hi and vocab and (lo_hi[0] < 0 or lo_hi[1] >= int(vocab)):
        out.add("llamacpp.d2t", "error", f"d2t maps draft tokens to ids {lo_hi[0]}..{lo_hi[1]}, outside the "
                f"vocabulary of {vocab}: llama.cpp would scatter logits out of bounds", f"{where}: tensor d2t",
                "re-export with draftsmith export --format gguf")
    if d["tensors"] is not None:
        _check_drafter_tensors(out, d, where)
    _check_norms(out, d)


def _check_drafter_tensors(out: Findings, d: dict, where: str) -> None:
    """The drafter GGUF holds every tensor llama.cpp's EAGLE-3 loader asks for, and no other."""
    names = d["tensors"]
    missing = sorted(facts.DRAFTER_TENSORS - names)
    extra = sorted(names - facts.DRAFTER_TENSORS - facts.OPTIONAL_DRAFTER_TENSORS)
    if missing:
        out.add("llamacpp.drafter-tensors", "error", f"the drafter GGUF lacks {', '.join(missing)}: llama.cpp "
                "refuses it at load (\"tensor not found\")", f"{where}: tensors", "export it again with draftsmith "
                "export --format gguf")
    if extra:
        out.add("llamacpp.drafter-tensors", "error", f"the drafter GGUF holds tensors llama.cpp's EAGLE-3 graph has "
                f"no place for ({', '.join(extra)}): it refuses it at load (\"wrong number of tensors\"); an "
                "EAGLE-3.1 norm's tensors, if they are such", f"{where}: tensors",
                "train without EAGLE-3.1 norms for llama.cpp")
    rows, want = d["output_rows"], d["draft_vocab"] if "d2t" in names else d["vocab"]
    if rows and want and int(rows) != int(want):
        out.add("llamacpp.drafter-tensors", "error", f"output.weight has {rows} rows, llama.cpp expects {want} "
                f"({'one per d2t entry' if 'd2t' in names else 'no d2t: one per target token'}): it refuses it at load",
                f"{where}: output.weight, d2t", "export it again with draftsmith export --format gguf")


def _check_target_tensors(out: Findings, t: dict) -> None:
    names = t["tensors"]
    if names is None:
        return
    if not names:
        out.add("llamacpp.target-tensors", "error", "the target GGUF holds no tensors (a vocabulary-only or "
                "header-only file): llama.cpp fails to load it", f"{t['path']}: 0 tensors",
                "pass the model's full .gguf")
    elif "token_embd.weight" not in names:
        out.add("llamacpp.target-tensors", "error", "the target GGUF has no token_embd.weight: llama.cpp fails to "
                "load it", f"{t['path']}: {len(names)} tensors", "pass the model's full .gguf")


def _check_norms(out: Findings, d: dict) -> None:
    """EAGLE-3.1 switches llama.cpp never reads, all named; the one it reads, said so."""
    where = str(d["path"])
    unread = facts.engine_unread_norms(d["switches"])
    if unread:
        out.add("llamacpp.norms", "error", f"{', '.join(unread)} on: llama.cpp's EAGLE-3 graph never applies "
                f"{'them' if len(unread) > 1 else 'it'}, so it would draft with a different network than the one "
                "trained", f"{where}: config",
                "train without EAGLE-3.1 norms for llama.cpp")
    if d["switches"].get("norm_before_residual"):
        out.add("llamacpp.norms", "info", "norm_before_residual: llama.cpp reads it (eagle3.norm_before_residual)",
                f"{where}: config")
