"""The one CLI grammar (issue 40 §5, §2) and the flags that gave tracebacks, hangs or silent runs (issue 44: 6, 11).

Every command names the same thing the same way: --device (auto by default), --dtype (compute dtype of the
model), --store-dtype / --export-dtype, one vLLM engine group, --json and --no-progress. Bad values are one line
on stderr and exit 2, checked before anything is loaded or created.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.testing.models import save_tiny_target, tiny_chat_corpus

SRC = Path(__file__).resolve().parents[1] / "src"


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _one_line_exit_2(argv: list[str], capsys) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals (a bad choice) exit from the parser
        code = e.code
    err = _stderr_lines(capsys)
    assert code == 2, (argv, err)
    assert len(err) == 1 and "error" in err[0], (argv, err)
    return err[0]


@pytest.fixture(scope="module")
def online(tmp_path_factory):
    """A tiny target and conversations: enough for train to start online (so a bad flag would reach the loop)."""
    root = tmp_path_factory.mktemp("grammar")
    model = save_tiny_target(root / "model", "llama")
    convs = root / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i:03d}", "messages": m}) + "\n"
                             for i, m in enumerate(tiny_chat_corpus(24))))
    return model, convs


def _parser_actions(command: str) -> dict[str, object]:
    from draftsmith.app.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {opt: act for act in sub.choices[command]._actions for opt in act.option_strings}


# --- the grammar ------------------------------------------------------------------------------------------
def test_auto_device_resolves_to_cpu_here_and_explicit_cpu_works():
    from draftsmith.core.device import DeviceError, resolve_device

    here = "cuda" if torch.cuda.is_available() else "cpu"  # cpu on the CPU-only test machines
    assert resolve_device("auto") == here == resolve_device(None)
    assert resolve_device("cpu") == "cpu" == resolve_device("CPU")
    with pytest.raises(DeviceError, match="expected auto"):
        resolve_device("bogus:7")


@pytest.mark.parametrize("command", ["decode", "generate", "capture", "train", "bench", "demo"])
def test_device_defaults_to_auto_on_every_command_that_runs_a_model(command):
    act = _parser_actions(command)["--device"]
    default = act.default
    if command == "train":  # train's flags default to None: the value comes from TrainConfig
        from draftsmith.stages.train.config import TrainConfig

        default = TrainConfig.fields()["device"].default
    assert default == "auto"


@pytest.mark.parametrize("command", ["decode", "generate", "capture", "bench"])
def test_dtype_is_the_compute_dtype_everywhere(command):
    act = _parser_actions(command)["--dtype"]
    assert list(act.choices) == ["float32", "bfloat16", "float16"]


def test_storage_and_export_dtypes_have_their_own_names():
    assert list(_parser_actions("capture")["--store-dtype"].choices) == ["bfloat16", "fp8"]
    assert list(_parser_actions("export")["--export-dtype"].choices) == ["bfloat16", "float16", "float32", "q8_0"]
    assert "--dtype" not in _parser_actions("export")


VLLM_GROUP = ["--vllm-python", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--max-num-seqs",
              "--kv-cache-gib", "--gpu-memory-utilization"]


@pytest.mark.parametrize("command", ["generate", "capture", "serve"])
def test_one_vllm_flag_group(command):
    actions = _parser_actions(command)
    # generate's vLLM backend is one engine process: data parallelism there is several servers (--backend openai).
    missing = [f for f in VLLM_GROUP if f not in actions and not (command == "generate" and f in ("-dp",
               "--data-parallel-size"))]
    assert not missing
    shown = [f for f, act in actions.items() if act.help != argparse.SUPPRESS]  # old names stay, hidden
    assert not [f for f in shown if f.startswith("--vllm-") and f not in ("--vllm-python", "--vllm-bin",
                                                                           "--vllm-import")]


def test_generate_wires_the_vllm_group_into_its_config(monkeypatch, tmp_path):
    import draftsmith.stages.generate.run as gen_run

    seen = {}

    def fake_generate(config):
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr(gen_run, "generate", fake_generate)
    with pytest.raises(SystemExit):
        main(["generate", "--self-prompt", "2", "--out", str(tmp_path / "o.jsonl"), "--backend", "vllm",
              "--vllm-python", sys.executable, "--max-num-seqs", "7", "--kv-cache-gib", "0.5", "-tp", "2",
              "--gpu-memory-utilization", "0.8"])
    cfg = seen["config"]
    assert (cfg.vllm_max_num_seqs, cfg.vllm_kv_cache_gib, cfg.vllm_tensor_parallel_size,
            cfg.vllm_gpu_memory_utilization, cfg.device) == (7, 0.5, 2, 0.8, "cpu")


def test_serve_passes_the_vllm_group_to_vllm_serve():
    from draftsmith.app.cli import _vllm_serve_args, build_parser

    args = build_parser().parse_args(["serve", "--target", "t", "--drafter", "d", "-tp", "2", "-dp", "3",
                                      "--max-num-seqs", "8", "--kv-cache-gib", "1"])
    assert _vllm_serve_args(args) == ["--tensor-parallel-size", "2", "--data-parallel-size", "3", "--max-num-seqs",
                                      "8", "--kv-cache-memory-bytes", str(1 << 30)]


@pytest.mark.parametrize("command", ["decode", "generate", "capture", "vocab", "train", "export", "import", "bench",
                                     "doctor", "demo"])
def test_json_on_every_command_that_reports(command):
    assert "--json" in _parser_actions(command)


@pytest.mark.parametrize("command", ["generate", "capture", "train", "bench", "demo"])
def test_no_progress_on_every_command_with_a_bar(command):
    act = _parser_actions(command)["--no-progress"]
    assert act.dest == "progress"


def test_every_train_flag_has_help_from_train_config():
    from draftsmith.stages.train.config import TrainConfig

    actions = _parser_actions("train")
    for name, f in TrainConfig.fields().items():
        act = actions["--" + name.replace("_", "-")]
        assert f.metadata["help"].strip() and act.help.startswith(f.metadata["help"]), name
    assert all(act.help and act.help.strip() for act in set(actions.values()))


# --- train number flags (issue 44, defect 6) -----------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [
    ("--ttt-steps", "1000000"), ("--grad-accum", "1000000000"),
    ("--save-every", "0"), ("--eval-every", "0"), ("--log-every", "0"),
    ("--max-steps", "-1"), ("--epochs", "0"),
    ("--eval-fraction", "2"), ("--eval-fraction", "-1"), ("--eval-fraction", "1.0"),
    ("--warmup-steps", "-1"), ("--step-decay", "-1"), ("--grad-clip", "-1"), ("--min-lr-ratio", "5"),
    ("--draft-vocab-size", "-1"), ("--lr", "nan"), ("--device", "bogus:7"),
])
def test_train_number_flags_are_bounded(online, tmp_path, capsys, flag, value):
    model, convs = online
    out = tmp_path / "run"
    err = _one_line_exit_2(["train", "--target", str(model), "--conversations", str(convs), "--out", str(out),
                            "--max-steps", "1", "--batch-tokens", "256", "--ttt-steps", "1", "--no-progress",
                            "--no-plot", flag, value], capsys)
    assert flag in err
    assert not out.exists()  # validated before anything is created


def test_grad_accum_past_the_data_is_refused_not_spun(online, tmp_path, capsys):
    model, convs = online
    err = _one_line_exit_2(["train", "--target", str(model), "--conversations", str(convs), "--out",
                            str(tmp_path / "run"), "--max-steps", "1", "--batch-tokens", "256", "--ttt-steps", "1",
                            "--grad-accum", "1000", "--no-progress", "--no-plot", "--eval-fraction", "0"], capsys)
    assert "--grad-accum 1000" in err


# --- flags that gave tracebacks (issue 44, defect 11) ----------------------------------------------------------
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="--device cuda is valid on this machine")


@pytest.mark.parametrize("extra", [pytest.param(["--device", "cuda"], marks=NO_CUDA), ["--device", "bogus:7"],
                                   ["--temperature", "nan"]])
def test_decode_bad_flags_are_one_line(online, capsys, extra):
    model, _ = online
    _one_line_exit_2(["decode", "--target", str(model), "--prompt", "hi", "--max-new-tokens", "2", *extra], capsys)


@NO_CUDA
def test_train_device_cuda_on_a_cpu_build_is_one_line(online, tmp_path, capsys):
    model, convs = online
    out = tmp_path / "run"
    err = _one_line_exit_2(["train", "--target", str(model), "--conversations", str(convs), "--out", str(out),
                            "--device", "cuda:0"], capsys)
    assert "--device cuda:0" in err and not out.exists()


def test_decode_explicit_cpu_runs(online, capsys):
    model, _ = online
    assert main(["decode", "--target", str(model), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] >= 1


@pytest.mark.slow  # bytes argv reach only a new interpreter, which imports torch
def test_non_utf8_prompt_is_one_line(online):
    model, _ = online
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([os.fsencode(sys.executable), b"-m", b"draftsmith.cli", b"decode", b"--target",
                           os.fsencode(model), b"--prompt", b"caf\xe9 \xff", b"--max-new-tokens", b"2"],
                          capture_output=True, env=env, timeout=120)
    err = [line for line in proc.stderr.decode(errors="replace").splitlines() if line.strip()]
    assert proc.returncode == 2 and len(err) == 1 and "UTF-8" in err[0], err


def test_train_dtype_float128_is_one_line(online, tmp_path, capsys):
    model, convs = online
    err = _one_line_exit_2(["train", "--target", str(model), "--conversations", str(convs), "--out",
                            str(tmp_path / "r"), "--dtype", "float128"], capsys)
    assert "float128" in err


def test_train_out_file_is_one_line(online, tmp_path, capsys):
    model, convs = online
    out = tmp_path / "a-file"
    out.write_text("keep me")
    err = _one_line_exit_2(["train", "--target", str(model), "--conversations", str(convs), "--out", str(out),
                            "--max-steps", "1", "--no-progress", "--no-plot"], capsys)
    assert "not a directory" in err and out.read_text() == "keep me"


def test_bench_out_file_is_one_line(online, tmp_path, capsys):
    model, _ = online
    out = tmp_path / "a-file"
    out.write_text("keep me")
    err = _one_line_exit_2(["bench", "--target", str(model), "--drafter", str(tmp_path / "none"), "--out", str(out),
                            "--no-progress"], capsys)
    assert "not a directory" in err and out.read_text() == "keep me"


def test_export_dtype_is_wired(monkeypatch, tmp_path, capsys):
    import draftsmith.stages.export as export_mod

    seen = {}

    def fake_export(drafter, out, fmt, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(export_mod, "export_drafter", fake_export)
    with pytest.raises(SystemExit):
        main(["export", "--drafter", str(tmp_path), "--format", "vllm", "--out", str(tmp_path / "o"),
              "--export-dtype", "float16"])
    assert seen["dtype"] == "fp16"


def test_demo_takes_device_and_needs_no_vllm_env(monkeypatch, capsys):
    import draftsmith.app.demo as demo

    seen = {}

    def fake_run_demo(preset, workdir, **kw):
        seen.update(kw)
        return {"ok": True}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert main(["demo", "--preset", "tiny", "--device", "cpu", "--json", "--no-progress"]) == 0
    assert seen["device"] == "cpu" and seen["vllm_python"] is None and seen["progress"] is False
    assert json.loads(capsys.readouterr().out) == {"ok": True}
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    demo_rule = next(line for line in makefile.splitlines() if line.startswith("demo:"))
    assert "VLLM" not in demo_rule


def test_generate_json_prints_its_summary(online, tmp_path, capsys):
    model, convs = online
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--input", str(convs), "--limit", "2", "--max-turns", "1", "--max-new-tokens", "2",
                 "--target", str(model), "--out", str(out), "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == 2 and report["done"] + report["error"] + report["skipped"] == 2
    assert report["out"] == str(out)
