"""OpenVINO GenAI as an EAGLE-3 engine (issue 52, item 5), without OpenVINO: the layer-id fix written into a
synthetic draft IR, the d2t read-back, doctor's openvino findings, and the bench's flag checks and counters. The
engine itself is driven by tests/test_openvino_engine.py (slow; needs .venv-openvino)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from draftsmith.core import openvino_facts as facts
from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import ConventionError
from draftsmith.core.errors import UsageError
from draftsmith.model.drafter import new_drafter
from draftsmith.model.target import load_target
from draftsmith.stages.export.checkpoint import DrafterCheckpoint, ExportError

# What optimum-intel writes at the end of a draft IR: the model-level rt_info after the graph (abridged).
IR = """<?xml version="1.0"?>
<net name="Model0" version="11">
\t<layers>
\t\t<layer id="0" name="hidden_states" type="Parameter" version="opset1"><data shape="?,?,192" element_type="f32" />
\t\t</layer>
\t</layers>
\t<edges />
\t<rt_info>
\t\t<Runtime_version value="2026.4.1" />
\t\t<eagle3_mode value="True" />
\t\t<optimum>
\t\t\t<optimum_intel_version value="2.2.0" />
\t\t</optimum>
\t</rt_info>
</net>
"""


# --- the layer-id convention -------------------------------------------------------------------------------------
def test_genai_ids_are_draftsmith_ids_minus_one():
    """SmolLM2's 30 layers: draftsmith's default (2, 15, 27) is GenAI's [1, 14, 26] (what the hand-fixed demo used);
    GenAI's own default [2, 15, 27] is one layer deeper."""
    assert facts.to_genai_layer_ids((2, 15, 27)) == [1, 14, 26]
    assert facts.from_genai_layer_ids([1, 14, 26]) == [2, 15, 27]
    assert facts.genai_default_layer_ids(30) == [2, 15, 27]
    with pytest.raises(ConventionError, match="layer 0"):
        facts.to_genai_layer_ids((0, 4, 6))
    with pytest.raises(ConventionError, match="exactly 3"):
        facts.to_genai_layer_ids((2, 4))


def test_hidden_layers_written_into_the_ir_rt_info():
    fixed = facts.with_hidden_layers(IR, [1, 14, 26])
    assert facts.read_hidden_layers(IR) is None
    assert facts.read_hidden_layers(fixed) == [1, 14, 26]
    # GenAI reads it as std::vector<int>: numbers separated by spaces, in the model-level rt_info
    assert '<hidden_layers_list value="1 14 26" />' in fixed
    rt = facts.read_rt_info(fixed)
    assert rt["eagle3_mode"] == "True" and rt["Runtime_version"] == "2026.4.1"
    assert "optimum_intel_version" not in rt  # nested sections stay nested
    assert '<optimum_intel_version value="2.2.0" />' in fixed and 'name="hidden_states"' in fixed
    again = facts.with_hidden_layers(fixed, [2, 3, 4])  # replaced, never listed twice
    assert facts.read_hidden_layers(again) == [2, 3, 4] and again.count("hidden_layers_list") == 1


def test_hidden_layers_refused_on_an_ir_that_is_not_an_eagle3_draft():
    with pytest.raises(ConventionError, match="eagle3_mode"):
        facts.with_hidden_layers(IR.replace('<eagle3_mode value="True" />', ""), [1, 2, 3])
    with pytest.raises(ConventionError, match="not an OpenVINO IR"):
        facts.with_hidden_layers("<model />", [1, 2, 3])


def test_fix_layer_ids_rewrites_the_file(tmp_path):
    from draftsmith.stages.export.openvino import fix_layer_ids

    xml = tmp_path / "openvino_model.xml"
    xml.write_text(IR)
    fix_layer_ids(xml, [1, 14, 26])
    assert facts.read_hidden_layers(xml.read_text()) == [1, 14, 26]
    assert [p.name for p in tmp_path.iterdir()] == ["openvino_model.xml"]  # no temporary left behind


def test_tree_kv_cache_precision():
    assert facts.kv_cache_precision(tree=False) == "f32" == facts.kv_cache_precision(tree=True)
    assert facts.kv_cache_precision(tree=False, requested="f16") == "f16"
    with pytest.raises(ConventionError, match="wrong output"):
        facts.kv_cache_precision(tree=True, requested="f16")


# --- the drafter the export accepts, and the IR it reads back ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from draftsmith.testing.models import save_tiny_target

    root = tmp_path_factory.mktemp("ov")
    target_dir = save_tiny_target(root / "target", "llama", "chatml")
    target = load_target(target_dir, pack=False)
    kept = torch.arange(0, target.vocab_size, 3)
    dv = vocab_mod.from_target_ids(kept, target.vocab_size)
    drafter = new_drafter(target, draft_vocab=dv, seed=0)
    return {"root": root, "target_dir": target_dir, "target": target, "drafter": drafter}


def test_export_refuses_what_the_graph_would_drop(tiny):
    from draftsmith.stages.export.openvino import check_drafter

    ckpt = DrafterCheckpoint.from_drafter(tiny["drafter"])
    assert check_drafter(ckpt, {}) == [i - 1 for i in ckpt.config.aux_layer_ids]
    for switch in ("norm_before_residual", "fc_norm", "norm_output", "norm_before_fc"):
        with pytest.raises(ExportError, match=switch):
            check_drafter(ckpt, {switch: True})


def test_ir_read_back_checks_layers_and_d2t_as_int64_offsets(tiny):
    from draftsmith.stages.export.openvino import _check_ir

    ckpt = DrafterCheckpoint.from_drafter(tiny["drafter"])
    d2t = [int(x) for x in ckpt.state["d2t"]]
    assert d2t[1] == 2 and ckpt.state["d2t"].dtype == torch.int64  # draft id 1 is target id 3: an offset of 2
    ids = [i - 1 for i in ckpt.config.aux_layer_ids]
    good = {"rt_info": {"eagle3_mode": "True", "hidden_layers_list": " ".join(map(str, ids))},
            "d2t": {"type": "i64", "values": d2t}}
    assert _check_ir(good, ids, ckpt) == "i64"
    bad_cases = [
        ({**good, "rt_info": {"eagle3_mode": "True"}}, "reads back as"),
        ({**good, "rt_info": {"hidden_layers_list": "1 2 3"}}, "eagle3_mode"),
        ({**good, "d2t": None}, "no d2t"),
        ({**good, "d2t": {"type": "i32", "values": d2t}}, "int64"),
        ({**good, "d2t": {"type": "i64", "values": [i + x for i, x in enumerate(d2t)]}}, "differs"),
    ]
    for seen, match in bad_cases:
        with pytest.raises(ExportError, match=match):
            _check_ir(seen, ids, ckpt)


# --- doctor --engine openvino ------------------------------------------------------------------------------------
def _draft_ir(tiny, name: str, rt_layers: list[int] | None, **config) -> str:
    """A draft IR folder as export --format openvino leaves it (the SGLang config beside a synthetic IR)."""
    from draftsmith.stages.export import export_drafter

    d = tiny["root"] / name
    export_drafter(tiny["drafter"], d, "sglang", dtype="fp32", overwrite=True)
    (d / "model.safetensors").unlink()
    cfg = json.loads((d / "config.json").read_text()) | config
    (d / "config.json").write_text(json.dumps(cfg))
    xml = IR if rt_layers is None else facts.with_hidden_layers(IR, rt_layers)
    (d / "openvino_model.xml").write_text(xml)
    return str(d)


def _doctor(target, drafter):
    from draftsmith.stages.doctor.diagnosis import diagnose

    return diagnose(target, drafter, engine="openvino")


def test_doctor_openvino_catches_the_layer_ids_one_deep(tiny):
    aux = list(tiny["drafter"].config.aux_layer_ids)
    n = tiny["target"].config.num_hidden_layers
    ok = _doctor(tiny["target_dir"], _draft_ir(tiny, "fixed", [i - 1 for i in aux]))
    assert not ok.blocking and "openvino.layer-ids" in ok.ids("info"), ok.summary()
    # optimum-intel's IR as it comes (no list): GenAI taps its default, which is not what the drafter learned
    raw = _doctor(tiny["target_dir"], _draft_ir(tiny, "raw", None))
    assert "openvino.layer-ids" in raw.ids("error") and raw.exit_code == 1
    assert f"GenAI taps {facts.genai_default_layer_ids(n)}" in raw.summary()
    # the list written in draftsmith's numbering: one layer deep, named so
    deep = _doctor(tiny["target_dir"], _draft_ir(tiny, "deep", aux))
    assert "openvino.layer-ids" in deep.ids("error") and "one layer deep" in deep.summary()


def test_doctor_openvino_names_norms_the_graph_does_not_implement(tiny):
    aux = list(tiny["drafter"].config.aux_layer_ids)
    r = _doctor(tiny["target_dir"], _draft_ir(tiny, "nbr", [i - 1 for i in aux], norm_before_residual=True))
    assert r.ids("error") == ["openvino.norm-before-residual"], r.summary()
    r = _doctor(tiny["target_dir"], _draft_ir(tiny, "norms", [i - 1 for i in aux], norm_output=True))
    assert r.ids("error") == ["openvino.norms"] and "norm_output" in r.summary()


def test_doctor_openvino_on_a_drafter_directory_and_the_engine_settings(tiny):
    d = tiny["root"] / "ds"
    tiny["drafter"].save(d)
    r = _doctor(tiny["target_dir"], d)
    assert not r.blocking, r.summary()
    assert "openvino.aux-convention" in r.ids("info") and "openvino.tree-kv-cache" in r.ids("warning")
    assert "openvino.target-arch" in r.ids("info")
    cfg = json.loads((d / "config.json").read_text())
    cfg["norm_before_residual"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    assert "openvino.norm-before-residual" in _doctor(tiny["target_dir"], d).ids("error")


def test_doctor_openvino_cli_exit_codes(tiny, capsys):
    from draftsmith.cli import main

    aux = list(tiny["drafter"].config.aux_layer_ids)
    assert main(["doctor", "--engine", "openvino", "--target", str(tiny["target_dir"]), "--drafter",
                 _draft_ir(tiny, "cli-ok", [i - 1 for i in aux])]) == 0
    assert main(["doctor", "--engine", "openvino", "--target", str(tiny["target_dir"]), "--drafter",
                 _draft_ir(tiny, "cli-raw", None)]) == 1
    assert "openvino.layer-ids" in capsys.readouterr().out
    assert main(["doctor", "--engine", "openvino", "--target", str(tiny["root"] / "nowhere")]) == 2


# --- bench --engine openvino: flags and counters -----------------------------------------------------------------
def _bench_args(**kw):
    base = dict(shape=None, hybrid=None, prompt_lookup="3", hybrid_min_ngram=None, readme=None,
                readme_section="bench", dtype=None, aux_layers=None, device=None, draft_max=None, chain=None,
                tree=None, threads=1, temperature="0", out="runs/x")
    return argparse.Namespace(**(base | kw))


def test_bench_openvino_args():
    from draftsmith.app.bench_openvino import check_openvino_args, methods_for

    assert check_openvino_args(_bench_args()) == ([3], None)
    assert check_openvino_args(_bench_args(draft_max="1,2", tree="3,2,6")) == ([1, 2], (3, 2, 6))
    assert check_openvino_args(_bench_args(tree="3,2,6")) == ([], (3, 2, 6))
    assert check_openvino_args(_bench_args(prompt_lookup="0")) == ([3], None)
    for kw, match in ((dict(shape="auto"), "--shape"), (dict(prompt_lookup="5"), "--prompt-lookup"),
                      (dict(temperature="1"), "greedy"),
                      (dict(tree="2,2,9"), "TOTAL"), (dict(draft_max="2", chain=2), "not both"),
                      (dict(device="cuda"), "--device")):
        with pytest.raises(UsageError, match=match):
            check_openvino_args(_bench_args(**kw))
    tree = methods_for([2], (3, 2, 6))[-1]
    assert tree == {"name": "eagle3 tree 3,2,6", "mode": "eagle3", "k": 6, "tree_depth": 3, "branching_factor": 2}


def test_bench_openvino_counts_like_llamacpp():
    """tau = 1 + accepted / verify passes, where a run's passes are its tokens less the first less those accepted."""
    from draftsmith.app.bench_openvino import summarize

    plain = [{"tokens": [1, 2, 3, 4, 5], "generate_ms": 60.0, "ttft_ms": 20.0, "accepted": 0}] * 2
    spec = [{"tokens": [1, 2, 3, 4, 5], "generate_ms": 40.0, "ttft_ms": 20.0, "accepted": 2, "draft_ms": 4.0},
            {"tokens": [1, 2, 3, 4, 6], "generate_ms": 40.0, "ttft_ms": 20.0, "accepted": 2, "draft_ms": 4.0}]
    p, s = summarize(plain, None), summarize(spec, plain)
    assert p["acceptance_length"] == 1.0 and p["tokens_per_second"] == 100.0
    assert s["acceptance_length"] == 2.0 and s["tokens_per_second"] == 200.0  # 4 tokens after the first: 2 passes
    assert s["same_as_plain"] == "1/2" and s["draft_share"] == 0.1


def test_export_openvino_cli_refusals(tiny, capsys):
    from draftsmith.cli import main

    d = tiny["root"] / "cli-drafter"
    tiny["drafter"].save(d)
    base = ["export", "--drafter", str(d), "--format", "openvino", "--out", str(tiny["root"] / "cli-out")]
    assert main(base) == 2 and "needs --target" in capsys.readouterr().err
    assert main([*base, "--target", str(tiny["target_dir"]), "--export-dtype", "float16"]) == 2
    assert "--openvino-weights" in capsys.readouterr().err
    assert main([*base, "--target", str(tiny["target_dir"]), "--include-embeddings"]) == 2
    assert not (tiny["root"] / "cli-out").exists()
