"""``doctor --engine openvino``: what OpenVINO GenAI does with a target and an EAGLE-3 drafter, from the files.

The drafter is either a draftsmith-readable directory (read as ``export --format openvino`` reads it, so what the
export refuses is an error here) or the draft IR itself (``openvino_model.xml`` + ``config.json``), whose rt_info
says which target layers GenAI will tap. Error findings name what GenAI's loader refuses, or what it misreads
silently: a layer list one deep (GenAI's default for an IR without one), switches the exported graph does not
implement. Engine settings that give wrong output (a tree over an f16 KV cache) are warnings: they are not in the
files. Facts: core/openvino_facts.py. Nothing here imports openvino.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from draftsmith.core import openvino_facts as facts
from draftsmith.core.conventions import ConventionError, norm_switches
from draftsmith.core.errors import one_line
from draftsmith.stages.doctor.hybrid_checks import check_layer_kinds
from draftsmith.stages.doctor.report import DoctorReport, DoctorUsageError, Findings


def diagnose_openvino(target: str | Path, drafter: str | Path | None = None) -> DoctorReport:
    """Check a target (smollm2, a Hugging Face folder or an IR folder) and drafter (directory or draft IR)."""
    t0 = time.perf_counter()
    report = DoctorReport(target=str(target), drafter=str(drafter) if drafter else None, engine="openvino",
                          engine_version=None, engine_profile=None, engine_source="n/a")
    out = Findings(report)
    tgt = _target_facts(target)
    out.facts.update(architecture=tgt["model_type"], num_layers=tgt["num_layers"], hidden_size=tgt["hidden_size"],
                     vocab_size=tgt["vocab_size"])
    _check_target(out, tgt)
    check_layer_kinds(out, tgt["config"])  # a hybrid: GenAI's tap on it is not tabulated (_check_target warns)
    _engine_notes(out)
    if drafter is not None:
        d = _drafter_facts(drafter)
        out.facts.update(drafter_format=d["format"], aux_layer_ids=d["aux"], draft_vocab_size=d["draft_vocab"])
        _check_drafter(out, tgt, d)
    report.seconds = time.perf_counter() - t0
    return report


# --- reading -----------------------------------------------------------------------------------------------------
def _config(p: Path) -> dict:
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DoctorUsageError(f"{p}/config.json: unreadable ({one_line(e)})") from e
    return raw if isinstance(raw, dict) else {}


def _target_facts(target: str | Path) -> dict:
    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    p = ensure_smollm2() if str(target) == EMBEDDED_DEFAULT else Path(target).expanduser()
    if not (p.is_dir() and (p / "config.json").is_file()):
        raise DoctorUsageError(f"{target}: OpenVINO GenAI serves a model folder (config.json with safetensors or "
                               "openvino_model.xml), or smollm2")
    raw = _config(p)
    text = raw.get("text_config") or raw
    return {"path": p, "model_type": text.get("model_type") or raw.get("model_type"),
            "num_layers": text.get("num_hidden_layers"), "hidden_size": text.get("hidden_size"),
            "vocab_size": text.get("vocab_size"), "ir": (p / facts.DRAFT_XML).is_file(), "config": text}


def _drafter_facts(drafter: str | Path) -> dict:
    p = Path(drafter).expanduser()
    if not (p.is_dir() and (p / "config.json").is_file()):
        raise DoctorUsageError(f"{drafter}: not a drafter directory (config.json) or draft IR folder")
    if (p / facts.DRAFT_XML).is_file():
        return _ir_facts(p)
    from draftsmith.stages.export.gguf import read_drafter

    base = {"format": "draftsmith (export --format openvino converts it)", "path": p, "ir": False, "rt": None}
    try:
        ckpt, switches = read_drafter(p)
    except Exception as e:  # noqa: BLE001 - whatever the reader refuses, the export refuses: reported, not raised
        raw = _config(p)
        on = {**norm_switches(raw), "norm_before_residual": bool(raw.get("norm_before_residual"))}
        return {**base, "refused": one_line(e), "aux": None, "switches": on, "draft_vocab": None, "vocab": None,
                "target_hidden": None}
    cfg = ckpt.config
    return {**base, "refused": None, "aux": list(cfg.aux_layer_ids) if ckpt.aux_known else None,
            "switches": switches, "draft_vocab": cfg.draft_vocab_size, "vocab": cfg.vocab_size,
            "target_hidden": cfg.target_hidden_size}


def _ir_facts(p: Path) -> dict:
    """A converted draft: its rt_info (what GenAI taps) and the config optimum-intel kept beside it."""
    raw = _config(p)
    try:
        rt = facts.read_rt_info((p / facts.DRAFT_XML).read_text())
    except Exception as e:  # noqa: BLE001 - a damaged IR is a finding of its own
        rt, bad = None, one_line(e)
    else:
        bad = None
    aux = raw.get("eagle_aux_hidden_state_layer_ids")  # top level: draftsmith's convention (the SGLang export's)
    if aux is None and isinstance(raw.get("eagle_config"), dict):
        nested = raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
        aux = [i + 1 for i in nested] if nested else None
    switches = {**norm_switches(raw), "norm_before_residual": bool(raw.get("norm_before_residual"))}
    return {"format": "openvino IR", "path": p, "ir": True, "rt": rt, "rt_error": bad, "refused": None,
            "aux": [int(i) for i in aux] if aux else None, "switches": switches,
            "draft_vocab": raw.get("draft_vocab_size"), "vocab": raw.get("vocab_size"),
            "target_hidden": raw.get("target_hidden_size") or raw.get("hidden_size")}


# --- checks ------------------------------------------------------------------------------------------------------
def _check_target(out: Findings, t: dict) -> None:
    mt = t["model_type"]
    where = f"{t['path']}/config.json: model_type = {mt!r}"
    if mt in facts.TAPPABLE_MODEL_TYPES:
        out.add("openvino.target-arch", "info", f"GenAI finds the layer outputs of {mt} targets (the residual Add "
                "after each gated MLP)", where)
    else:
        out.add("openvino.target-arch", "warning", f"cannot tell whether GenAI finds the tapped layers of a {mt} "
                "target (it matches the residual Add after a gated MLP in nodes named layers.i/)", where,
                "run bench --engine openvino on a few prompts: a target it cannot tap fails at load")


def _engine_notes(out: Findings) -> None:
    out.add("openvino.tree-kv-cache", "warning", "a tree (tree_depth/branching_factor) over GenAI's default f16 KV "
            "cache gives wrong output on CPU (0/5 equal to plain in f32); over u8, chains and trees equalled plain on "
            "4/6 MT-bench turns; over f32 on 6/6", "OpenVINO GenAI 2026.4.1, measured",
            "decode with KV_CACHE_PRECISION f32 (bench --engine openvino does)")
    out.add("openvino.precision", "info", "outputs equal plain token for token only in f32 compute "
            "(INFERENCE_PRECISION_HINT f32); in bf16, GenAI's own plain backends disagree with each other",
            "OpenVINO GenAI 2026.4.1 on an AMX CPU, measured")


def _check_drafter(out: Findings, t: dict, d: dict) -> None:
    where = str(d["path"])
    if d.get("refused"):
        out.add("openvino.export", "error", f"export --format openvino refuses this drafter: {d['refused']}", where,
                "fix what the message names, or export the drafter from its training checkpoint")
    _check_switches(out, d, where)
    aux = d["aux"]
    if d["ir"]:
        _check_ir(out, t, d, where)
    elif aux is not None:
        try:
            ids = facts.to_genai_layer_ids(aux)
        except ConventionError as e:
            out.add("openvino.aux-layers", "error", str(e), f"{where}: aux layers {aux}",
                    "train with 3 aux layers, none of them 0")
        else:
            out.add("openvino.aux-convention", "info", f"aux ids {aux} (input of layer L) are GenAI's {ids} (output "
                    "of layer i): export --format openvino writes them into the IR's rt_info", f"{where}: aux {aux}")
    if t["num_layers"] and aux and any(not 0 < int(i) <= int(t["num_layers"]) for i in aux):
        out.add("openvino.aux-layers", "error", f"aux ids {aux} exceed the target's {t['num_layers']} layers",
                f"{where}: aux {aux}", "use a drafter made for this target")
    if t["hidden_size"] and d["target_hidden"] and int(d["target_hidden"]) != int(t["hidden_size"]):
        out.add("openvino.width", "error", f"the drafter reads target states of width {d['target_hidden']}, the "
                f"target's are {t['hidden_size']}", f"{where}: target_hidden_size", "use a drafter for this target")
    if t["vocab_size"] and d["vocab"] and int(d["vocab"]) != int(t["vocab_size"]):
        out.add("openvino.vocab", "error", f"the drafter's vocabulary ({d['vocab']}) is not the target's "
                f"({t['vocab_size']}): GenAI copies the target's embedding into the draft", f"{where}: vocab_size",
                "use a drafter for this target")


def _check_switches(out: Findings, d: dict, where: str) -> None:
    unread = facts.unread_switches(d["switches"])
    if "norm_before_residual" in unread:
        out.add("openvino.norm-before-residual", "error", "norm_before_residual on: optimum-intel's EAGLE-3 layer "
                "takes the residual before hidden_norm, so GenAI serves another network than the one trained, silently",
                f"{where}: config norm_before_residual", "train with norm_before_residual off for OpenVINO")
    norms = [n for n in unread if n != "norm_before_residual"]
    if norms:
        out.add("openvino.norms", "error", f"{', '.join(norms)} on: optimum-intel's EAGLE-3 graph has no such norm, "
                "so the export drops it and GenAI drafts with a different network, silently", f"{where}: config",
                "train without EAGLE-3.1 norms for OpenVINO")


def _check_ir(out: Findings, t: dict, d: dict, where: str) -> None:
    xml = f"{where}/{facts.DRAFT_XML}"
    if d["rt"] is None:
        out.add("openvino.draft-ir", "error", f"GenAI cannot read the draft IR: {d['rt_error']}", xml,
                "export it again with draftsmith export --format openvino")
        return
    if str(d["rt"].get(facts.RT_EAGLE3_MODE, "")).lower() != "true":
        out.add("openvino.draft-ir", "error", "the IR has no rt_info eagle3_mode=True: GenAI runs it as an ordinary "
                "draft model (no target states), not as EAGLE-3", f"{xml}: rt_info",
                "export it with draftsmith export --format openvino")
        return
    listed = d["rt"].get(facts.RT_HIDDEN_LAYERS)
    served = ([int(x) for x in listed.replace(",", " ").split()] if listed is not None
              else facts.genai_default_layer_ids(int(t["num_layers"])) if t["num_layers"] else None)
    if d["aux"] is None:
        out.add("openvino.layer-ids", "warning", f"the draft's config names no aux layers; GenAI taps {served}",
                f"{where}/config.json", "export with draftsmith export --format openvino")
        return
    try:
        want = facts.to_genai_layer_ids(d["aux"])
    except ConventionError as e:
        out.add("openvino.aux-layers", "error", str(e), f"{where}: aux {d['aux']}", "train with 3 aux layers, none 0")
        return
    source = (f"rt_info hidden_layers_list = {listed}" if listed is not None
              else f"no rt_info hidden_layers_list: GenAI's default [2, N/2, N-3] = {served}")
    if served != want:
        off = ("one layer deep: GenAI's id i is the output of layer i, draftsmith's L the input of layer L"
               if served is not None and [s - 1 for s in served] == want else "other layers than it was trained on")
        out.add("openvino.layer-ids", "error", f"GenAI taps {served}, the drafter was trained on {want} in GenAI's "
                f"numbering (draftsmith {d['aux']}): {off}; it runs and accepts less, with no error",
                f"{xml}: {source}", "export with draftsmith export --format openvino (it writes the list)")
    else:
        out.add("openvino.layer-ids", "info", f"GenAI taps {served} = draftsmith's {d['aux']}", f"{xml}: {source}")


__all__ = ["diagnose_openvino"]
