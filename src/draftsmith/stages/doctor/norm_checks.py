"""EAGLE-3.1 checks: the drafter's norm switches against its tensors, and against what the engine computes.

Both failures load fine and draft worse, which is why they are found here, before the load: a 3.0 drafter
labelled 3.1 (or the reverse) runs a norm it never trained, or skips one it did; an engine version that does not
read a switch drafts without that norm. Facts: ``core.conventions`` (field and tensor names, as speculators, vLLM
and SpecForge write them) and ``core.vllm_facts`` (which vLLM versions read which switch).
"""

from __future__ import annotations

from draftsmith.core import vllm_facts
from draftsmith.core.conventions import INPUT_NORM_WEIGHT, NORM_SWITCHES, is_norm_weight, norm_mismatches, norm_switches
from draftsmith.stages.doctor.report import Findings
from draftsmith.stages.doctor.state import DrafterFiles, EngineFacts

# SGLang (public source, mid-2026 on; not checked against an installed SGLang): llama_eagle3 reads fc_norm and
# norm_output from config.json; it has no input_norm (norm_before_fc), and its loader skips unknown weights silently.
SGLANG_NORMS = frozenset({"fc_norm", "norm_output"})


def check_drafter_norms(out: Findings, engine: EngineFacts, d: DrafterFiles) -> None:
    """Switches against tensors, then against the engine; nothing to say about an EAGLE-3 drafter."""
    on = norm_switches(d.cfg)
    names = set(d.names) if d.weights is not None else None
    tensors = sorted(n for n in names or () if is_norm_weight(n))
    active = [k for k in NORM_SWITCHES if on[k]]
    out.facts["eagle31_norms"] = active
    if not active and not tensors:
        return
    where = "drafter config.json"
    if on["norm_before_fc"] and on["fc_norm"]:
        out.add("drafter.norms", "error", "norm_before_fc and fc_norm are both on: speculators refuses such a "
                "config and vLLM would apply both norms, which no trainer trains",
                f"{where}: norm_before_fc = true, fc_norm = true", "keep the one the drafter was trained with")
    if names is not None:
        _check_labels(out, d, on, names, tensors)
    _check_engine(out, engine, d, active, names)


def _n_aux(d: DrafterFiles) -> int | None:
    fc = d.names.get("fc.weight")
    th = d.target_hidden
    if fc is not None and len(fc.shape) == 2 and isinstance(th, int) and th and fc.shape[1] % th == 0:
        return fc.shape[1] // th
    return None


def _check_labels(out: Findings, d: DrafterFiles, on: dict[str, bool], names: set[str], tensors: list[str]) -> None:
    """The config's switches name exactly the norm tensors the weights hold, of the widths fc reads."""
    n_aux = _n_aux(d)
    wrong = norm_mismatches(on, names, n_aux)
    switches = ", ".join(f"{k} = {str(on[k]).lower()}" for k in ("norm_before_fc", "fc_norm"))
    if wrong:
        labelled_31 = any("is on but" in w for w in wrong)
        says = ", ".join(f'"{k}": {str(v).lower()}' for k, v in (
            ("norm_before_fc", INPUT_NORM_WEIGHT in names), ("fc_norm", len(tensors) > (INPUT_NORM_WEIGHT in names))))
        what = ("a drafter trained without the norm, labelled EAGLE-3.1: the engine would run a norm of untrained "
                "(unit) weights" if labelled_31 else
                "an EAGLE-3.1 drafter labelled EAGLE-3: vLLM drops the norm's tensor without a word and drafts "
                "without the norm it was trained with")
        out.add("drafter.norms-mislabelled", "error", f"{'; '.join(wrong)}: {what}; it loads and accepts less",
                f"drafter config.json: {switches}; {d.weights_file}: {', '.join(tensors) or 'no norm tensors'}",
                f"set {says} in config.json, as the tensors say; or, if the drafter was trained with a norm whose "
                "tensor is missing, re-export it from its training checkpoint")
    th = d.target_hidden
    if not isinstance(th, int):
        return
    want = {n: (th,) for n in tensors if n != INPUT_NORM_WEIGHT}
    if n_aux:
        want[INPUT_NORM_WEIGHT] = (n_aux * th,)
    bad = [f"{n} {list(d.names[n].shape)} (want {list(s)})" for n, s in want.items()
           if n in d.names and tuple(d.names[n].shape) != s]
    if bad:
        out.add("weights.shapes", "error", "EAGLE-3.1 norm tensors do not fit the aux states fc reads: "
                + "; ".join(bad), f"{d.weights_file} vs drafter config.json (target_hidden_size = {th})",
                "re-export the drafter from its checkpoint")


def _check_engine(out: Findings, engine: EngineFacts, d: DrafterFiles, active: list[str],
                  names: set[str] | None) -> None:
    """Does the engine compute every switch that is on? One it ignores loads fine and drafts without the norm."""
    if not active or engine.name == "draftsmith":
        return
    if engine.name == "sglang":
        missing = [k for k in active if k not in SGLANG_NORMS]
        if missing:
            out.add("sglang.norms-ignored", "error", f"SGLang's llama_eagle3 does not compute {', '.join(missing)} "
                    f"(no input_norm) and skips {INPUT_NORM_WEIGHT} silently: the drafter would start and draft "
                    "without the norm it was trained with", f"drafter config.json: {', '.join(missing)} = true",
                    "serve it with vLLM >= 0.32 (which computes it) or draftsmith, or retrain with fc_norm")
        rest = [k for k in active if k in SGLANG_NORMS]
        if rest:
            out.add("sglang.norms-version", "warning", f"SGLang reads {', '.join(rest)} only in versions from "
                    "mid-2026; an older one loads this EAGLE-3.1 drafter without them and accepts less",
                    f"drafter config.json: {', '.join(rest)} = true", "check that your SGLang's llama_eagle3.py "
                    "reads " + " and ".join(rest))
        return
    if engine.name != "vllm" or engine.profile is None:
        return
    honoured, how = _vllm_norms(engine, d.format == "speculators")
    ignored = [k for k in active if k not in honoured]
    out.facts["vllm_norms_ignored"] = ignored
    if not ignored:
        return
    version = engine.version or engine.profile.name
    path = "speculators config reader and llama_eagle3" if d.format == "speculators" else "llama_eagle3 drafter"
    raises = (names is not None and INPUT_NORM_WEIGHT in names and "norm_before_fc" not in (
        engine.profile.drafter_norms if engine.live is None else honoured))
    consequence = (f"its loader knows no {INPUT_NORM_WEIGHT} and fails on it after the target has loaded" if raises
                   else "it loads the drafter and drafts without the norm, silently losing acceptance")
    out.add("vllm.norms-ignored", "error", f"vLLM {version}'s {path} does not read {', '.join(ignored)}: "
            f"{consequence}", f"drafter config.json: {', '.join(f'{k} = true' for k in ignored)} ({how})",
            "use vLLM 0.32 or later (it reads norm_before_fc, fc_norm and norm_output), or serve with draftsmith",
            engine_fact=True)


def _vllm_norms(engine: EngineFacts, speculators: bool) -> tuple[frozenset[str], str]:
    if engine.live is not None:
        read = vllm_facts.norms_from_source(engine.live.root)
        if read is not None:
            return read[1] if speculators else read[0], f"vLLM {engine.live.version} source: llama_eagle3.py" + (
                ", speculators/algos.py" if speculators else "")
    p = engine.profile
    return (p.speculators_norms if speculators else p.drafter_norms), f"vLLM {p.name} facts table"


__all__ = ["SGLANG_NORMS", "check_drafter_norms"]
