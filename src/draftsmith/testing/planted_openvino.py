"""Known silent faults built into an OpenVINO GenAI draft IR (issue 52), where optimum-intel's converter and GenAI's
loader accept them.

An IR cannot be edited tensor by tensor like a GGUF, so the weight faults are planted one step earlier, into the
SGLang folder optimum-intel converts (``planted.plant_hf``), and converted; the tapped-layer fault is the IR as
optimum-intel writes it (no ``hidden_layers_list``: GenAI's default, one layer deep); ``norm_before_residual`` is a
drafter trained with it, converted without ``export --format openvino``'s refusal (the graph has no such switch).
The good export's card is copied beside each planted IR: it says what was trained, the files say otherwise.
Needs OpenVINO's environment (``make openvino-env``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from draftsmith.testing.planted import fit_chain_drafter, fitted_smollm2_run

#: Faults and how they are planted: in the IR's rt_info, in the converted folder, or by the drafter itself.
OPENVINO_FAULTS = ("layer-list-absent", "d2t-dropped", "d2t-absolute", "d2t-shuffled", "norm-before-residual")
HF_PLANTED = ("d2t-dropped", "d2t-absolute", "d2t-shuffled")


def _copy_card(src_dir: Path, dst_dir: Path) -> None:
    for name in ("README.md", "drafter_card.json"):
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, dst_dir / name)


def convert_raw(drafter_dir: str | Path, out: str | Path, *, target: str = "smollm2", hf_fault: str | None = None,
                layer_list: bool = True, python: str | Path | None = None) -> Path:
    """``drafter_dir`` converted to a draft IR as ``export --format openvino`` would, less its checks: ``hf_fault``
    planted into the SGLang folder first, the layer list written or not."""
    from draftsmith.core import openvino_facts as facts
    from draftsmith.integrations.openvino import optimum_export
    from draftsmith.stages.export.gguf import read_drafter
    from draftsmith.stages.export.openvino import fix_layer_ids, sglang_source, target_source_dir
    from draftsmith.testing.planted import plant_hf

    out = Path(out)
    ckpt, _ = read_drafter(drafter_dir)
    with tempfile.TemporaryDirectory(prefix="draftsmith-plant-ov-") as tmp:
        hf = sglang_source(ckpt, target_source_dir(target), Path(tmp) / "sglang")
        if hf_fault is not None:
            hf = plant_hf(hf, Path(tmp) / "planted", hf_fault)
        if out.exists():
            shutil.rmtree(out)
        optimum_export(hf, out, python=python)
    if layer_list:
        fix_layer_ids(out / facts.DRAFT_XML, facts.to_genai_layer_ids(ckpt.config.aux_layer_ids))
    return out


def openvino_world(root: str | Path, new_tokens: int = 32, python: str | Path | None = None) -> dict:
    """The fitted SmolLM2 run (``planted.fitted_smollm2_run``) exported as a draft IR with its card (expectation
    decoded on the fitting prompts), and a second drafter fitted the same way with ``norm_before_residual`` on."""
    import torch

    from draftsmith.model.target import load_target
    from draftsmith.stages.calibration import CalibrationSet, decoded_expectation
    from draftsmith.stages.export.openvino import export_openvino

    root = Path(root)
    fitted = fitted_smollm2_run(root, new_tokens)
    good = root / "openvino-good"
    if not (good / "drafter_card.json").is_file():
        export_openvino(fitted["drafter_dir"], good, target="smollm2", python=python, overwrite=True,
                        card={"decoded": fitted["decoded"]})
    nbr = root / "run-nbr" / "best"
    if not (nbr / "decoded.json").is_file():  # the same fit, with norm_before_residual on
        from draftsmith.core import vocab as vocab_mod
        from draftsmith.model.drafter import load_drafter

        target = load_target("smollm2", pack=False, dtype=torch.float32)
        base = load_drafter(fitted["drafter_dir"], target)
        dv = vocab_mod.from_target_ids(base.d2t + torch.arange(base.d2t.numel()), target.vocab_size)
        seqs = [p + t for p, t in zip(fitted["prompts"], _greedy(target, fitted["prompts"], new_tokens), strict=True)]
        drafter, acc = fit_chain_drafter(target, dv, seqs, norm_before_residual=True)
        drafter.save(nbr)
        (nbr / "eval.json").write_text(json.dumps({"step": 60, "acc": acc, "tokens": sum(map(len, seqs))}))
        cal = CalibrationSet(fitted["prompts"], "the prompts the drafter was fitted on", False)
        decoded = decoded_expectation(target, drafter, cal, k=5, max_new_tokens=new_tokens)
        (nbr / "decoded.json").write_text(json.dumps(decoded))
    return {**fitted, "good": good, "nbr_drafter_dir": nbr}


def _greedy(target, prompts, new_tokens: int) -> list[list[int]]:
    from draftsmith.stages.decode import SpeculativeDecoder

    plain = SpeculativeDecoder(target)
    eos = [target.tokenizer.eos_token_id]
    return [plain.generate(p, max_new_tokens=new_tokens, eos_token_ids=eos).token_ids for p in prompts]


def plant_openvino(world: dict, dst: str | Path, fault: str, python: str | Path | None = None) -> Path:
    """A draft IR with ``fault`` at ``dst``, the card beside it saying what was trained."""
    from draftsmith.core import openvino_facts as facts
    from draftsmith.stages.export.card import card_facts, write_card
    from draftsmith.stages.export.readers import read_checkpoint

    if fault not in OPENVINO_FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    dst = Path(dst)
    if fault == "layer-list-absent":  # the IR as optimum-intel writes it
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(world["good"], dst)
        xml = dst / facts.DRAFT_XML
        xml.write_text(facts.without_hidden_layers(xml.read_text()))
        return dst
    if fault == "norm-before-residual":
        src = world["nbr_drafter_dir"]
        convert_raw(src, dst, python=python)
        ckpt = read_checkpoint(src)
        decoded = json.loads((Path(src) / "decoded.json").read_text())
        write_card(dst, card_facts(fmt="openvino", out=dst, drafter_config=ckpt.config, source=src,
                                   base_model=None, num_speculative_tokens=3, files=[], d2t=ckpt.state.get("d2t"),
                                   decoded=decoded))
        return dst
    convert_raw(world["drafter_dir"], dst, hf_fault=fault, python=python)
    _copy_card(Path(world["good"]), dst)
    return dst


__all__ = ["OPENVINO_FAULTS", "convert_raw", "openvino_world", "plant_openvino"]
