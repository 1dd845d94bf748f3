"""Issue 52 in the real engines (slow; run under `flock /tmp/engine.lock`): a good export of a fitted drafter passes
``draftsmith check`` with its served acceptance near the card's, and every planted silent fault is caught by doctor
or check with its cause named; vLLM's ``serve --check`` flags a planted collapse within the first 16 requests.

Each llama.cpp check runs in its own process: llama.cpp aborts the process on some malformed drafters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CHECK = """
import json, sys
from draftsmith.stages.check import CheckOptions, run_check
r = run_check(CheckOptions(**json.loads(sys.argv[1])))
print("CHECK " + json.dumps(r.to_dict()), flush=True)
"""
#: The cause check must name for each planted fault (doctor's blocking finding counts as caught too).
GGUF_CAUSE = {"aux-ids-plus-1": "aux-ids-off-by-one", "d2t-offsets": "d2t-offsets", "d2t-dropped": "d2t-missing",
              "norm-before-residual-flipped": "norm-before-residual", "d2t-shuffled": "wrong-draft-vocab"}
HF_CAUSE = {"norm-output-stripped": "norm-ignored", "aux-ids-minus-1": "aux-ids-off-by-one",
            "d2t-dropped": "d2t-missing", "d2t-absolute": "d2t-offsets",
            "norm-before-residual-dropped": "norm-before-residual", "d2t-shuffled": "wrong-draft-vocab"}


def _check(job: dict, timeout: float = 1800) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, "-c", CHECK, json.dumps(job)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("CHECK ")), None)
    assert line is not None, f"check crashed (exit {p.returncode}): {p.stderr[-2000:]}"
    return json.loads(line[6:])


@pytest.fixture(scope="module")
def gguf_world(tmp_path_factory):
    pytest.importorskip("xllamacpp")
    from draftsmith.testing.planted import llamacpp_world

    return llamacpp_world(tmp_path_factory.mktemp("planted-gguf"))


def _gguf_job(world, drafter) -> dict:
    return {"engine": "llamacpp", "target": str(world["target_gguf"]), "drafter": str(drafter),
            "prompts": world["prompts"], "k": 3, "max_new_tokens": world["new_tokens"], "force": True}


def test_llamacpp_good_export_served_as_its_card(gguf_world):
    r = _check(_gguf_job(gguf_world, gguf_world["good"]))
    assert r["verdict"] == "pass" and r["exit_code"] == 0, r
    assert abs(r["served_tau"] - r["card_tau"]) <= 0.05 * r["card_tau"], r  # the card decoded, llama.cpp served
    eq = r["equality"]
    assert eq["identical"] + len(eq["near_ties"]) == eq["compared"], r  # no real divergence from plain


@pytest.mark.parametrize("fault", sorted(GGUF_CAUSE))
def test_llamacpp_planted_fault_is_caught(gguf_world, tmp_path, fault):
    from draftsmith.testing.planted import plant_gguf

    r = _check(_gguf_job(gguf_world, plant_gguf(gguf_world["good"], tmp_path, fault)))
    assert r["exit_code"] == 1, r
    assert r["doctor_blocking"] or GGUF_CAUSE[fault] in {f["cause"] for f in r["findings"]}, r


@pytest.fixture(scope="module")
def hf_world(tmp_path_factory):
    """A tiny Llama vLLM's CPU attention accepts (head_dim 32), noisy enough that flags matter (init 0.3), and a
    drafter (norm_before_residual and norm_output on) fitted to its greedy continuations, exported for vLLM with a
    card whose expectation is a draftsmith decode of the same prompts."""
    if not VLLM_PYTHON.is_file():
        pytest.skip("no .venv-vllm (make vllm-env)")
    import torch
    from conftest import random_prompts

    from draftsmith.core import vocab as vocab_mod
    from draftsmith.model.target import load_target
    from draftsmith.stages.calibration import CalibrationSet, decoded_expectation
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.export import export_drafter
    from draftsmith.testing.models import save_tiny_target
    from draftsmith.testing.planted import fit_chain_drafter

    root = tmp_path_factory.mktemp("planted-hf")
    save_tiny_target(root / "target", "llama", "chatml", seed=1, num_attention_heads=2, num_key_value_heads=1,
                     initializer_range=0.3)
    target = load_target(str(root / "target"), dtype=torch.float32, pack=False)
    prompts = random_prompts(6, seed=3, vocab=200, max_len=8)
    plain = SpeculativeDecoder(target)
    seqs = [p + plain.generate(p, 32).token_ids for p in prompts]
    kept = torch.cat([torch.tensor([t for s in seqs for t in s]), torch.arange(64)])
    dv = vocab_mod.from_target_ids(kept, target.vocab_size)
    drafter, _ = fit_chain_drafter(target, dv, seqs, steps=120, norm_before_residual=True, norm_output=True)
    drafter.save(root / "best")
    decoded = decoded_expectation(target, drafter, CalibrationSet(prompts, "the fitting prompts", False), k=5,
                                  max_new_tokens=32)
    good = export_drafter(root / "best", root / "good", "vllm", dtype="fp32", card={"decoded": decoded}).path
    return {"root": root, "target": str(root / "target"), "good": good, "prompts": prompts}


def _hf_job(world, drafter) -> dict:
    return {"engine": "vllm", "target": world["target"], "drafter": str(drafter), "prompts": world["prompts"],
            "k": 3, "max_new_tokens": 32, "vllm_python": str(VLLM_PYTHON), "force": True}


def test_vllm_good_export_served_as_its_card(hf_world):
    r = _check(_hf_job(hf_world, hf_world["good"]))
    assert r["verdict"] == "pass" and r["exit_code"] == 0, r
    assert abs(r["served_tau"] - r["card_tau"]) <= 0.05 * r["card_tau"], r
    assert r["equality"]["identical"] == r["equality"]["compared"], r  # vLLM: lossless token for token


@pytest.mark.parametrize("fault", sorted(HF_CAUSE))
def test_vllm_planted_fault_is_caught(hf_world, tmp_path, fault):
    from draftsmith.testing.planted import plant_hf

    r = _check(_hf_job(hf_world, plant_hf(hf_world["good"], tmp_path / fault, fault)))
    assert r["exit_code"] == 1, r
    assert r["doctor_blocking"] or HF_CAUSE[fault] in {f["cause"] for f in r["findings"]}, r


def test_vllm_serve_check_flags_a_planted_collapse(hf_world, tmp_path):
    """A real `vllm serve` of the d2t-dropped drafter (loads, drafts, accepts ~nothing: 1.09): serve --check strict
    stops it and exits 1 within 16 requests."""
    from draftsmith.testing.planted import plant_hf

    planted = plant_hf(hf_world["good"], tmp_path / "planted", "d2t-dropped")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "draftsmith.cli", "serve", "--target", hf_world["target"],
                        "--drafter", str(planted), "--port", str(port), "--vllm-python", str(VLLM_PYTHON),
                        "--check", "strict", "--force", "--", "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager"],
                       capture_output=True, text=True, timeout=1800, env=env)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "SILENT COLLAPSE" in p.stderr and "requests" in p.stderr


# --- OpenVINO GenAI (make openvino-env): the good IR passes, each planted fault is caught with its cause ---------
OPENVINO_CAUSE = {"layer-list-absent": "aux-ids-off-by-one", "d2t-dropped": "wrong-draft-vocab",  # uninitialised d2t
                  "d2t-absolute": "d2t-offsets", "d2t-shuffled": "wrong-draft-vocab",
                  "norm-before-residual": "norm-before-residual"}


@pytest.fixture(scope="module")
def ov_world(tmp_path_factory):
    from draftsmith.integrations.openvino import available

    if not available():
        pytest.skip("OpenVINO's environment is not built (make openvino-env)")
    from draftsmith.testing.planted_openvino import openvino_world

    return openvino_world(tmp_path_factory.mktemp("planted-ov"))


def _ov_job(world, ir, reference) -> dict:
    return {"engine": "openvino", "target": "smollm2", "drafter": str(ir), "prompts": world["prompts"], "k": 3,
            "max_new_tokens": world["new_tokens"], "draftsmith_target": "smollm2", "force": True,
            "reference_drafter": str(reference)}


def test_openvino_good_export_passes_check(ov_world):
    r = _check(_ov_job(ov_world, ov_world["good"], ov_world["drafter_dir"]))
    assert r["verdict"] == "pass" and r["exit_code"] == 0, r
    assert abs(r["served_tau"] - r["draftsmith_tau"]) <= 0.1 * r["draftsmith_tau"], r  # issue 52's OpenVINO goal
    assert r["equality"]["identical"] == r["equality"]["compared"], r  # f32 over an f32 KV cache: equal to plain


@pytest.mark.parametrize("fault", sorted(OPENVINO_CAUSE))
def test_openvino_planted_fault_is_caught(ov_world, tmp_path, fault):
    from draftsmith.testing.planted_openvino import plant_openvino

    ir = plant_openvino(ov_world, tmp_path / fault, fault)
    ref = ov_world["nbr_drafter_dir"] if fault == "norm-before-residual" else ov_world["drafter_dir"]
    r = _check(_ov_job(ov_world, ir, ref))
    assert r["exit_code"] == 1, r
    assert r["doctor_blocking"] or OPENVINO_CAUSE[fault] in {f["cause"] for f in r["findings"]}, r
