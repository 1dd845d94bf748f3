"""bench's own arithmetic: the speedup bound and the tie test that explains half-precision divergences."""

from __future__ import annotations

import torch

from draftsmith.app.bench import diverged_at_tie, speedup_bound
from draftsmith.model.target import Target
from draftsmith.stages.decode import SpeculativeDecoder
from draftsmith.testing.models import build_tiny_model


def test_speedup_bound_is_tau_times_step_over_round():
    plain = {"verify_passes": 0, "step_time": 0.05}
    method = {"verify_passes": 10, "verify_time": 0.6, "draft_time": 0.1, "acceptance_length": 2.1}
    assert abs(speedup_bound(method, plain) - 2.1 * 0.05 / 0.07) < 1e-12
    assert speedup_bound(plain, plain) is None


def test_diverged_at_tie_tells_rounding_ties_from_real_differences():
    model = build_tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=4)
    target = Target(model)
    prompt = [5, 9, 17, 3]
    plain = SpeculativeDecoder(target, None, None).generate(prompt, 6).token_ids
    j = 3
    with torch.no_grad():
        logits = target(torch.tensor([prompt + plain[:j]]), cache=target.new_cache()).logits[0, -1]
        worst = int(logits.argmin())
        # A token whose output row equals the chosen token's: its logit is the same number, an exact tie.
        twin = worst
        target.lm_head.weight[twin] = target.lm_head.weight[plain[j]]
    assert diverged_at_tie(target, prompt, plain, plain[:j] + [twin])
    target.lm_head.weight.data[twin] = -target.lm_head.weight.data[plain[j]]  # now far apart
    assert not diverged_at_tie(target, prompt, plain, plain[:j] + [twin])
    # One output a prefix of the other (a stop token in one only) is not a tie.
    assert not diverged_at_tie(target, prompt, plain, plain[:j])


# --- issue 19.7: nonsense options and empty prompt sets are one-line errors with exit code 2 ----------------
import json  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def bench_dirs(tmp_path_factory):
    from draftsmith.model.drafter import new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.testing.tokenizer import make_tokenizer

    root = tmp_path_factory.mktemp("bench")
    tok = make_tokenizer("chatml")
    model = build_tiny_model("llama", vocab_size=len(tok), eos_token_id=tok.eos_token_id, num_hidden_layers=4)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    new_drafter(load_target(root / "model")).save(root / "drafter")
    (root / "one.jsonl").write_text(json.dumps({"prompt": "hello there"}) + "\n")
    (root / "bad.jsonl").write_text("{not json\n" + json.dumps({"messages": []}) + "\n")
    return root


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--turns", "0"], "--turns must be >= 1"),
    (["--chain", "0"], "chain length must be >= 1, got 0"),
    (["--chain", "65"], "at most 64"),
    (["--tree", "1,600,10"], "draft vocabulary"),  # depth 1: within the candidates bound
    (["--prompt-lookup", "-1"], "--prompt-lookup must be >= 0"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--hybrid-min-ngram", "0", "--shape", "auto"], "--hybrid-min-ngram takes N >= 1"),
    (["--datasets", "{bad}"], "no usable prompt"),
])
def test_bench_bad_input_one_line_exit_2(bench_dirs, capsys, tmp_path, args, message):
    from draftsmith.cli import main

    argv = ["bench", "--target", str(bench_dirs / "model"), "--drafter", str(bench_dirs / "drafter"),
            "--datasets", str(bench_dirs / "one.jsonl"), "--max-new-tokens", "2", "--out", str(tmp_path / "b"),
            "--no-progress"]
    for a in args:  # later flags win with argparse; "{bad}" names the all-invalid JSONL
        argv.append(a.replace("{bad}", str(bench_dirs / "bad.jsonl")))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out
    assert message in err and err.startswith("draftsmith: error:") and len(err.strip().splitlines()) == 1
    assert out == "" and not (tmp_path / "b").exists()


def test_bench_refuses_a_shape_the_drafter_cannot_draft_before_calibrating(bench_dirs, capsys, tmp_path, monkeypatch):
    """The expectation's calibration decodes prompts (minutes on a real model): a bad --tree is refused first."""
    from draftsmith.cli import main
    from draftsmith.stages import shapes

    monkeypatch.setattr(shapes, "expectation_basis", lambda *a, **k: pytest.fail("calibrated before refusing"))
    code = main(["bench", "--target", str(bench_dirs / "model"), "--drafter", str(bench_dirs / "drafter"),
                 "--datasets", str(bench_dirs / "one.jsonl"), "--tree", "1,600,10", "--out", str(tmp_path / "b")])
    assert code == 2 and "draft vocabulary" in capsys.readouterr().err


def test_run_bench_refuses_an_empty_prompt_set_before_decoding(bench_dirs):
    from draftsmith.app.bench import run_bench
    from draftsmith.core.errors import UsageError
    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import ChainSpec

    target = load_target(bench_dirs / "model")
    drafter = load_drafter(bench_dirs / "drafter", target)
    with pytest.raises(UsageError, match=r"bad\.jsonl: no usable prompt"):
        run_bench(target, drafter, [str(bench_dirs / "bad.jsonl")], [ChainSpec(2)], progress=False)
    with pytest.raises(UsageError, match="max_new_tokens must be >= 1"):
        run_bench(target, drafter, [str(bench_dirs / "one.jsonl")], [ChainSpec(2)], max_new_tokens=-1,
                  progress=False)


def test_bench_shape_auto_hybrid_comes_with_its_tree(bench_dirs, capsys, tmp_path, monkeypatch):
    """A chosen hybrid is measured next to its bare tree and its siblings at --hybrid-min-ngram's other N; all
    stay lossless (fp32)."""
    from draftsmith.cli import main
    from draftsmith.stages import shapes

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    # A weak drafter and a strong lookup, on a nearly flat verify curve: the hybrid 2,4,6 is the argmax (a chain
    # or tree wins for a strong drafter), with lookup 10: lookup reaches 8 deep here, so 16 only costs more.
    # The curve is given, since a measured one moves with machine load.
    good = shapes.Acceptance(((0.3, 0.2, 0.1, 0.1),) * 8, "test", lookup=(0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1),
                             lookup_rate=1.0)
    monkeypatch.setattr(shapes, "calibrate_acceptance", lambda *a, **k: good)
    flat = {n: 0.01 * (1 + 0.02 * (n - 1)) for n in shapes.DEFAULT_KS}
    monkeypatch.setattr(shapes, "measure_verify_cost",
                        lambda *a, **k: shapes.VerifyCost(0.01, flat, flat, {w: 5e-4 for w in (1, 4, 6, 8, 10)}))
    code = main(["bench", "--target", str(bench_dirs / "model"), "--drafter", str(bench_dirs / "drafter"),
                 "--datasets", str(bench_dirs / "one.jsonl"), "--max-new-tokens", "8", "--dtype", "float32",
                 "--chain", "2", "--shape", "auto", "--hybrid-min-ngram", "1,2", "--out", str(tmp_path / "b"),
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    chosen = report["auto_shape"]["shape"]
    assert chosen == "hybrid 2,4,6+lookup 10" and f"shape: {chosen} (expected" in err
    methods = report["results"][0]["methods"]
    # ... and next to its sibling at n>=2 (decoded though `good` has no n>=2 reach to weigh).
    assert list(methods) == ["plain", "eagle3 chain k=2", "eagle3 tree 2,4,6", chosen, f"{chosen} (n>=2)",
                             "prompt lookup k=3"]
    assert all(m["identical_to_plain"] == "1/1" for name, m in methods.items() if name != "plain")


def test_bench_readme_fills_its_own_section_and_a_missing_one_fails_first(bench_dirs, capsys, tmp_path):
    from draftsmith.cli import main

    readme = tmp_path / "README.md"
    other = "<!-- bench:start -->\nthe other machine's table\n<!-- bench:end -->\n"
    readme.write_text(f"# x\n{other}\n<!-- bench-amx:start -->\nold\n<!-- bench-amx:end -->\ntail\n")
    argv = ["bench", "--target", str(bench_dirs / "model"), "--drafter", str(bench_dirs / "drafter"),
            "--datasets", str(bench_dirs / "one.jsonl"), "--max-new-tokens", "4", "--dtype", "float32",
            "--chain", "2", "--prompt-lookup", "0", "--no-progress", "--readme", str(readme)]
    code = main([*argv, "--readme-section", "nowhere", "--out", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and "has no <!-- nowhere:start -->" in err and not (tmp_path / "none").exists()
    assert main([*argv, "--readme-section", "bench-amx", "--out", str(tmp_path / "b")]) == 0
    text = readme.read_text()
    assert other in text and text.endswith("<!-- bench-amx:end -->\ntail\n") and "old" not in text
    table = text.split("<!-- bench-amx:start -->")[1]
    assert "| eagle3 chain k=2 |" in table and "linears)" in table and "AMX" in table
    assert "--readme-section bench-amx" in table  # the command that wrote it


def test_bench_measures_prompt_lookup_at_each_length_given(bench_dirs, capsys, tmp_path):
    """`--prompt-lookup 2,5`: the free baseline at both lengths, each lossless; the hybrid takes the first."""
    from draftsmith.cli import main

    code = main(["bench", "--target", str(bench_dirs / "model"), "--drafter", str(bench_dirs / "drafter"),
                 "--datasets", str(bench_dirs / "one.jsonl"), "--max-new-tokens", "8", "--dtype", "float32",
                 "--tree", "2,2,3", "--hybrid", "--prompt-lookup", "2,5", "--out", str(tmp_path / "b"),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    methods = json.loads((tmp_path / "b" / "bench.json").read_text())["results"][0]["methods"]
    assert list(methods) == ["plain", "eagle3 tree 2,2,3", "hybrid 2,2,3+lookup 2", "prompt lookup k=2",
                             "prompt lookup k=5"]
    assert all(m["identical_to_plain"] == "1/1" for name, m in methods.items() if name != "plain")
    # Issue 60: every method's expectation (calibrated on the mixed set) beside its measurement, and the table
    # prints both; the report says where the expectation came from and what a card could promise.
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert "draftsmith-mixed-v1" in report["expected_from"][0]
    for m in methods.values():
        tau = m["expected"]["tau"]
        assert tau["low"] <= tau["point"] <= tau["high"] and m["expected"]["speedup"]["point"] > 0
    assert methods["plain"]["expected"]["tau"]["point"] == 1.0
    assert report["card_expectation"]["prompts"]["set"] == "draftsmith-mixed-v1"
    table = (tmp_path / "b" / "bench.txt").read_text()
    assert "expected" in table.splitlines()[0] and "from calibration on" in table
