"""``doctor --engine llamacpp``: what llama.cpp does with a target GGUF and an EAGLE-3 drafter, from file headers.

The verdict names the engine's own outcome: an error finding means llama.cpp refuses the pair at load (drafter keys,
aux count, widths) or loads it and aborts at the first decode (a target architecture whose graph exposes no layer
inputs), or drafts with switches it never reads; no error means it loads and drafts. Facts: core/llamacpp_facts.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftsmith.core import llamacpp_facts as facts
from draftsmith.stages.doctor.report import DoctorReport, DoctorUsageError, Findings


def diagnose_llamacpp(target: str | Path, drafter: str | Path | None = None) -> DoctorReport:
    """Check a target (a .gguf, 'smollm2', or a model directory) and drafter (.gguf or drafter directory)."""
    t0 = time.perf_counter()
    report = DoctorReport(target=str(target), drafter=str(drafter) if drafter else None, engine="llamacpp",
                          engine_version=_engine_version(), engine_profile=None, engine_source="n/a")
    out = Findings(report)
    tgt = _target_facts(target)
    out.facts.update(architecture=tgt["arch"], num_layers=tgt["num_layers"], hidden_size=tgt["hidden_size"],
                     vocab_size=tgt["vocab_size"])
    _check_target_arch(out, tgt)
    out.add("llamacpp.chain", "info", "llama.cpp drafts a chain only (--draft-max k tokens per round, no trees): "
            "draftsmith's tree numbers do not carry over; bench --engine llamacpp measures the chain",
            "llama.cpp common/speculative.cpp: draft-eagle3 is a chain drafter")
    if drafter is not None and _is_block(drafter):  # DFlash / DSpark: the block checks, as llama.cpp reads them
        from draftsmith.stages.doctor.block_checks import TargetShape, check_block_drafter, check_block_gguf

        shape = TargetShape(tgt["num_layers"], tgt["vocab_size"], tgt["vocab_size"])
        p = Path(drafter).expanduser()
        if p.suffix == ".gguf":
            check_block_gguf(out, shape, tgt["hidden_size"], p)
        else:
            check_block_drafter(out, "llamacpp", shape, p)
    elif drafter is not None:
        d = _drafter_facts(drafter)
        out.facts.update(drafter_format=d["format"], aux_layer_ids=d["aux"], draft_vocab_size=d["draft_vocab"])
        _check_drafter(out, tgt, d)
    report.seconds = time.perf_counter() - t0
    return report


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
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise DoctorUsageError(f"{path}: not a readable GGUF ({' '.join(str(e).split())})") from e
    fields = {k: f.contents() for k, f in reader.fields.items()
              if k.startswith(keys_prefix) and k != "tokenizer.ggml.tokens" and not k.startswith("tokenizer.ggml.m")}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    fields["_vocab"] = len(tokens.data) if tokens is not None else None
    fields["_tensors"] = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in reader.tensors}
    return fields


def _target_facts(target: str | Path) -> dict:
    from draftsmith.model.sources import EMBEDDED_DEFAULT, smollm2_gguf_path

    p = smollm2_gguf_path() if str(target) == EMBEDDED_DEFAULT else Path(target).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        f = _gguf_fields(p, ("general.", "llama.", "qwen", "gemma", "gpt-oss", "lfm2", "phi3", "smollm3"))
        arch = str(f.get("general.architecture"))
        return {"source": f"{p.name}: general.architecture", "arch": arch,
                "num_layers": f.get(f"{arch}.block_count"), "hidden_size": f.get(f"{arch}.embedding_length"),
                "vocab_size": f["_vocab"]}
    if p.is_dir() and (p / "config.json").is_file():
        raw = json.loads((p / "config.json").read_text())
        text = raw.get("text_config") or raw
        mt = text.get("model_type") or raw.get("model_type")
        archs = raw.get("architectures") or [None]
        return {"source": f"config.json: model_type = {mt!r} (llama.cpp converts it to a GGUF)",
                "arch": facts.gguf_arch(mt, archs[0]), "hf_model_type": mt,
                "num_layers": text.get("num_hidden_layers"), "hidden_size": text.get("hidden_size"),
                "vocab_size": text.get("vocab_size")}
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
                "d2t_type": d2t[0] if d2t else None,
                "draft_vocab": d2t[1][0] if d2t else (out[1][-1] if out else None), "vocab": f["_vocab"]}
    if p.is_dir() and (p / "config.json").is_file():
        from draftsmith.model.drafter import DrafterConfig
        from draftsmith.stages.export.readers import read_checkpoint

        raw = json.loads((p / "config.json").read_text())
        try:
            ckpt = read_checkpoint(p)
            cfg, aux_known = ckpt.config, ckpt.aux_known
        except Exception as e:  # noqa: BLE001 - this build's reader may refuse a variant (EAGLE-3.1 norms)
            try:
                cfg, aux_known = DrafterConfig.from_hf_config(raw), True
            except Exception:  # noqa: BLE001
                raise DoctorUsageError(f"{drafter}: not a drafter draftsmith reads ({' '.join(str(e).split())})"
                                       ) from e
        switches = {n: bool(raw.get(n) or getattr(cfg, n, False)) for n in (*facts.READS_NORMS, *facts.UNREAD_NORMS)}
        return {"format": "draftsmith (export --format gguf writes llama.cpp's)", "path": p, "arch": "eagle3",
                "aux": list(cfg.aux_layer_ids) if aux_known and cfg.aux_layer_ids else None,
                "target_hidden": cfg.target_hidden_size, "switches": switches, "d2t_type": "I64",
                "draft_vocab": cfg.draft_vocab_size, "vocab": cfg.vocab_size}
    raise DoctorUsageError(f"{drafter}: not an EAGLE-3 drafter (.gguf file or drafter directory)")


# --- checks ------------------------------------------------------------------------------------------------------
def _check_target_arch(out: Findings, t: dict) -> None:
    arch, ok = t["arch"], facts.target_supported(t["arch"])
    supported = ", ".join(sorted(facts.TARGET_ARCHES))
    if ok:
        out.add("llamacpp.target-arch", "info", f"llama.cpp extracts EAGLE-3 layer inputs from {arch} targets",
                t["source"] + f" = {arch}")
    elif ok is False:
        out.add("llamacpp.target-arch", "error", f"llama.cpp's {arch} graph exposes no layer inputs: the pair loads, "
                "then aborts at the first decode (GGML_ASSERT \"layer input tensor is null\")",
                t["source"] + f" = {arch}", f"serve a target of architecture {supported}, or use vLLM/SGLang")
    else:
        out.add("llamacpp.target-arch", "warning", f"cannot tell whether llama.cpp drafts for this target ({arch})",
                t["source"], f"llama.cpp's EAGLE-3 targets: {supported}")


def _check_drafter(out: Findings, t: dict, d: dict) -> None:
    where = str(d["path"])
    if d["arch"] != facts.GGUF_ARCH:
        out.add("llamacpp.drafter-arch", "error", f"the drafter GGUF is architecture {d['arch']!r}, not eagle3",
                f"{where}: general.architecture", "export it with draftsmith export --format gguf")
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
    unread = facts.engine_unread_norms(d["switches"])
    if unread:
        out.add("llamacpp.norms", "error", f"{', '.join(unread)} on: llama.cpp's EAGLE-3 graph never applies it, so "
                "it would draft with a different network than the one trained", f"{where}: config",
                "train without EAGLE-3.1 norms for llama.cpp")
    if d["switches"].get("norm_before_residual"):
        out.add("llamacpp.norms", "info", "norm_before_residual: llama.cpp reads it (eagle3.norm_before_residual)",
                f"{where}: config")
