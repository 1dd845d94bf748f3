"""Hybrid targets in llama.cpp itself (PyPI xllamacpp): a tiny LFM2 (short convolutions, then attention) and a tiny
Qwen3.5 (gated delta-net, then attention), converted by testing/target_gguf.py, served plain and with a draftsmith
EAGLE-3 drafter exported by ``export --format gguf``.

The bug class this guards: a speculative engine must put every recurrent state (convolution window, delta-net
state) back where the accepted prefix ends (llama.cpp shipped LFM2's window diverging at the first rejected
token). So the drafter is fitted well but not perfectly: its runs reject drafts, and the output must still equal
plain's, token for token. Served acceptance must be within 5% of draftsmith's own decoder on the same prompts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("gguf")

from draftsmith.integrations.llamacpp import LlamaCppEngine, verify_passes  # noqa: E402
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder  # noqa: E402
from draftsmith.testing.target_gguf import hybrid_llamacpp_world  # noqa: E402

pytestmark = pytest.mark.slow
K = 3


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5_text"])
def world(request, tmp_path_factory):
    return hybrid_llamacpp_world(tmp_path_factory.mktemp(f"{request.param}_llamacpp"), request.param)


def _tokens(engine: LlamaCppEngine, prompt: list[int], n: int) -> tuple[list[int], dict]:
    """Greedy token ids (llama.cpp's logprobs carry them) and the engine's timings."""
    r = engine.server.handle_completions({"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                          "cache_prompt": False, "logprobs": 1})
    return [int(c["id"]) for c in r["choices"][0]["logprobs"]["content"]], r["timings"]


def test_plain_llama_cpp_decodes_what_transformers_decodes(world):
    """The converter is faithful: llama.cpp's greedy answers are draftsmith's, up to the end-of-turn token."""
    plain = LlamaCppEngine(world["target_gguf"], "plain")
    for prompt, answer in zip(world["prompts"], world["answers"], strict=True):
        got, _ = _tokens(plain, prompt, world["new_tokens"])
        assert got == answer
    assert len({tuple(a) for a in world["answers"]}) > 1  # the fitted target answers prompts differently


def test_eagle3_keeps_plain_output_through_rejections(world):
    plain = LlamaCppEngine(world["target_gguf"], "plain")
    spec = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=world["drafter_gguf"], k=K)
    drafted = accepted = 0
    for prompt in world["prompts"]:
        a, _ = _tokens(plain, prompt, world["new_tokens"])
        b, t = _tokens(spec, prompt, world["new_tokens"])
        assert b == a  # a convolution window left on a rejected draft would change the tokens after it
        drafted, accepted = drafted + t["draft_n"], accepted + t["draft_n_accepted"]
    assert accepted > 0  # the drafter ran and was used
    assert accepted < drafted  # and drafts were rejected: the rollback path ran


def test_served_acceptance_within_5_percent_of_draftsmith(world):
    """Verify passes per prompt, the engine's against draftsmith's chain of the same length.

    llama.cpp drafts ``K`` tokens every round here (``draft.n_min`` 0, ``p_min`` 0, answers end at the end-of-turn
    token well before ``n_predict``), so its rounds are exactly ``draft_n / K``: what ``EngineRun.verify_passes``
    counts (``completion - 1 - draft_n_accepted`` alone comes out short: llama.cpp counts drafts accepted past
    the end-of-turn token).
    """
    from draftsmith.model.drafter import load_drafter

    target = world["target"]
    ours = SpeculativeDecoder(target, load_drafter(world["drafter_dir"], target), ChainSpec(K))
    spec = LlamaCppEngine(world["target_gguf"], "eagle3", drafter=world["drafter_gguf"], k=K)
    emitted = passes_ours = passes_engine = 0
    for prompt, answer in zip(world["prompts"], world["answers"], strict=True):
        r = ours.generate(prompt, max_new_tokens=world["new_tokens"], eos_token_ids=world["eos"])
        assert r.token_ids == answer
        got, t = _tokens(spec, prompt, world["new_tokens"])
        assert got == answer and t["draft_n"] % K == 0, t
        assert verify_passes(len(got), t["draft_n"], t["draft_n_accepted"], K) == t["draft_n"] // K, t
        emitted += len(answer) - 1  # the first token comes from prefill in both
        passes_ours, passes_engine = passes_ours + len(r.accepted_per_step), passes_engine + t["draft_n"] // K
    tau_ours, tau_engine = emitted / passes_ours, emitted / passes_engine
    print(f"{world['arch']} chain k={K}: draftsmith tau {tau_ours:.3f}, llama.cpp tau {tau_engine:.3f}")
    assert tau_ours > 2.0  # the fitted drafter is worth comparing
    assert abs(tau_engine - tau_ours) <= 0.05 * tau_ours, (tau_engine, tau_ours)


def test_doctor_passes_the_pair_llama_cpp_serves(world):
    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp

    report = diagnose_llamacpp(world["target_gguf"], world["drafter_gguf"])
    assert not report.blocking, report.summary()


def test_check_passes_the_pair_with_output_equal_to_plain(world):
    """``draftsmith check`` on the hybrid pair: llama.cpp's output equals plain (no divergence, no near-tie flip
    needed), and served acceptance is draftsmith's own."""
    from draftsmith.stages.check import CheckOptions, run_check

    r = run_check(CheckOptions(engine="llamacpp", target=str(world["target_gguf"]), drafter=str(world["drafter_gguf"]),
                               prompts=world["prompts"], k=K, max_new_tokens=world["new_tokens"],
                               draftsmith_target=str(world["model_dir"]), reference_drafter=str(world["drafter_dir"])))
    d = r.to_dict()
    print(f"check on {world['arch']}: served tau {d['served_tau']:.3f}, draftsmith's {d['draftsmith_tau']:.3f}, "
          f"{d['verdict']}")
    assert d["equality"]["identical"] == d["equality"]["compared"] == len(world["prompts"]), d
    assert d["verdict"] == "pass" and d["exit_code"] == 0, d
    assert abs(d["served_tau"] - d["draftsmith_tau"]) <= 0.05 * d["draftsmith_tau"], d


def test_the_cli_pipeline_forges_a_drafter_llama_cpp_serves_for_a_hybrid(tmp_path, capsys):
    """generate -> capture -> train -> export -> doctor -> check with the command line on the tiny fitted LFM2: the
    drafter draftsmith trains is served by llama.cpp with output equal to plain and acceptance that check passes."""
    import json

    from draftsmith.cli import main
    from draftsmith.testing.models import tiny_chat_corpus

    world = hybrid_llamacpp_world(tmp_path / "world", "lfm2", n_prompts=8, new_tokens=32)
    target, gguf = str(world["model_dir"]), str(world["target_gguf"])
    with open(tmp_path / "questions.jsonl", "w") as f:  # training questions: other seeds than the check's prompts
        for i, conv in enumerate(tiny_chat_corpus(96, seed=4242)):
            f.write(json.dumps({"id": f"q{i}", "messages": conv[:1]}) + "\n")
    (tmp_path / "check.jsonl").write_text("".join(json.dumps({"prompt": c[0]["content"]}) + "\n"
                                                  for c in tiny_chat_corpus(6, seed=999)))
    steps = [
        ["generate", "--target", target, "--input", str(tmp_path / "questions.jsonl"), "--out",
         str(tmp_path / "conversations.jsonl"), "--max-new-tokens", "48", "--no-progress"],
        ["capture", "--target", target, "--conversations", str(tmp_path / "conversations.jsonl"), "--out",
         str(tmp_path / "store"), "--max-length", "256", "--no-progress"],
        ["train", "--target", target, "--store", str(tmp_path / "store"), "--out", str(tmp_path / "run"),
         "--max-steps", "300", "--max-length", "256", "--batch-tokens", "1024", "--no-plot", "--no-progress"],
        ["export", "--drafter", str(tmp_path / "run" / "best"), "--format", "gguf", "--target", gguf, "--out",
         str(tmp_path / "drafter.gguf")],
        ["doctor", "--target", gguf, "--drafter", str(tmp_path / "drafter.gguf"), "--engine", "llamacpp"],
    ]
    for argv in steps:
        assert main(argv) == 0, argv[0]
    capsys.readouterr()
    code = main(["check", "--engine", "llamacpp", "--target", gguf, "--drafter", str(tmp_path / "drafter.gguf"),
                 "--draftsmith-target", target, "--reference-drafter", str(tmp_path / "run" / "best"),
                 "--prompts", str(tmp_path / "check.jsonl"), "--limit", "6", "--max-new-tokens", "32",
                 "--num-speculative-tokens", "3", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(f"check: served tau {report['served_tau']:.3f}, draftsmith's {report['draftsmith_tau']:.3f}, "
          f"card {report['card_tau']}, {report['verdict']}")
    assert report["equality"]["identical"] == report["equality"]["compared"] == 6, report
    assert abs(report["served_tau"] - report["draftsmith_tau"]) <= 0.05 * report["draftsmith_tau"], report
    assert code == 0 and report["verdict"] == "pass", report
