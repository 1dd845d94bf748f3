"""The demo's closing summary: the verdict of the numbers first, then how to use the drafter (app/demo_summary.py)."""

from __future__ import annotations

import shlex

from draftsmith.app.bench import format_table
from draftsmith.app.cli import build_parser
from draftsmith.app.demo_summary import shape_flags, summary_text, verdict
from draftsmith.stages.verify_cost import VerifyCost

STEP = 0.040  # seconds of a one-token step; rows' timings are in these units


def row(tau: float, speedup: float, bound: float | None = None) -> dict:
    """A bench method row as run_bench writes it (the fields the table and the summary read)."""
    bound = speedup if bound is None else bound
    passes = 100
    return {"acceptance_length": tau, "speedup": speedup, "speedup_bound": None if tau == 1.0 else bound,
            "tokens_per_second": 25.0 * speedup, "seconds": 10.0, "verify_passes": passes,
            "verify_time": passes * STEP * tau / bound * 0.9, "draft_time": passes * STEP * tau / bound * 0.1,
            "prefill_time": 0.5, "overhead_time": 0.2, "acceptance_per_position": [round(tau - 1, 2)],
            "identical_to_plain": "4/4", "diverged_at_tie": 0}


def curve(per_token: float) -> dict:
    """A verify curve whose n-token pass costs 1 + per_token * (n - 1) steps."""
    points = {n: STEP * (1 + per_token * (n - 1)) for n in (1, 2, 3, 4, 8, 16, 32)}
    return VerifyCost(STEP, points, points, {1: STEP / 10, 4: STEP / 8}).to_dict()


def report(methods: dict, auto: dict, flags: list[str], cpu: str = "AMD EPYC 7B13") -> dict:
    return {"target": "smollm2", "dtype": "bfloat16", "packed": False, "max_new_tokens": 128,
            "machine": {"cpu": cpu, "cores": 2, "torch_threads": 2, "torch": "2.13.0", "python": "3.11",
                        "cuda": None, "flags": flags},
            "results": [{"dataset": "mt-bench", "temperature": 0.0, "prompts": 4, "methods": methods}],
            "auto_shape": auto}


def result(vllm_env: bool = True) -> dict:
    """What run_demo hands the summary besides the bench report."""
    return {"target": "smollm2", "drafter": "runs/demo/run/best", "export": "runs/demo/export/vllm",
            "workdir": "runs/demo", "settings": {"chain": 2}, "simulated_acceptance_length": 1.21,
            "vllm_serve": "vllm serve /m/smollm2 --speculative-config '{\"method\": \"eagle3\"}'",
            "vllm_env": vllm_env, "seconds": {"total": 1224.0}, "seconds_all_sessions": {"total": 1224.0,
                                                                                         "sessions": 1}}


def avx2_nothing_pays() -> dict:
    """The issue's run: 2-core AVX2-only CPU, every method slower than plain, --shape auto chose plain."""
    methods = {"plain": row(1.0, 1.0), "eagle3 chain k=2": row(1.36, 0.66, 0.68),
               "eagle3 tree 2,4,6": row(1.52, 0.45, 0.47), "prompt lookup k=3": row(1.15, 0.72, 0.74),
               "prompt lookup k=10": row(1.21, 0.53, 0.55)}
    auto = {"shape": "plain", "expected_speedup": 1.0, "reason": "no shape pays on this machine; best was chain 1 "
            "at 0.90x", "candidates": {"chain 1": 0.90, "chain 2": 0.82}, "verify_cost": curve(0.37),
            "dtype": "dtype bfloat16"}
    return report(methods, auto, ["avx2"])


def amx_hybrid_pays() -> dict:
    methods = {"plain": row(1.0, 1.0), "eagle3 chain k=2": row(1.40, 1.17, 1.18),
               "eagle3 tree 2,6,10": row(1.69, 1.27, 1.28), "hybrid 2,6,10+lookup 3": row(2.13, 1.58, 1.61),
               "prompt lookup k=3": row(1.38, 1.30, 1.31), "prompt lookup k=10": row(1.41, 1.27, 1.30)}
    auto = {"shape": "hybrid 2,6,10+lookup 3", "expected_speedup": 1.38, "reason": "expected 1.38x: ...",
            "candidates": {"hybrid 2,6,10+lookup 3": 1.38}, "verify_cost": curve(0.0125), "dtype": "dtype bfloat16"}
    return report(methods, auto, ["amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f"],
                  cpu="Intel(R) Xeon(R) Processor")


def decode_line(text: str) -> str:
    return next(line.strip() for line in text.splitlines() if line.strip().startswith("draftsmith decode"))


def test_nothing_pays_leads_with_the_verdict_and_why_and_recommends_no_serving():
    rep = avx2_nothing_pays()
    text = summary_text(result(vllm_env=False), rep, format_table(rep))
    lines = text.splitlines()
    assert lines[0].startswith("verdict: no drafting shape pays on this machine")
    assert "--shape auto chose plain decoding" in lines[0] and "chain 2 0.66x" in lines[0]
    # Why: what a 16-token verify pass costs in steps on this CPU kind (1 + 0.37 * 15 on the measured curve).
    assert lines[1].startswith("why:") and "AVX2 only" in lines[1]
    assert "a 16-token verify pass costs 6.55x a one-token step of 40.0 ms" in lines[1]
    assert "verify cost is what is missing" in lines[1]
    assert "needs tau > 2.00 to break even" in lines[1]  # chain 2: tau 1.36 at bound 0.68
    assert lines[2].startswith("where it would pay instead: a GPU engine") and "AMX" in lines[2]
    assert lines.index("use it:") > lines.index("") > 2  # the table comes after the verdict, commands after it
    assert "serve it" not in text
    serve = next(line for line in lines if "--speculative-config" in line)
    assert serve.startswith("to serve on a GPU engine (not here: chain 2, which vLLM would draft, measured 0.66x")
    assert "make vllm-env" in serve  # the vLLM env is optional and absent here
    assert "--shape auto" in decode_line(text) and "picks plain decoding here" in text


def test_hybrid_pays_names_the_shape_its_speedups_and_the_decode_command():
    rep = amx_hybrid_pays()
    res = result()
    text = summary_text(res, rep, format_table(rep))
    lines = text.splitlines()
    assert lines[0].startswith("verdict: hybrid 2,6,10+lookup 3 pays on this machine: 1.58x plain decoding "
                               "measured")
    assert "--shape auto expected 1.38x" in lines[0]
    assert "1.22x prompt lookup (prompt lookup k=3 1.30x" in lines[0]  # 1.58 / 1.30
    assert lines[1].startswith("why:") and "AMX" in lines[1] and "costs 1.19x a one-token step" in lines[1]
    assert not any(line.startswith("where it would pay instead") for line in lines)
    decode = decode_line(text)
    args = build_parser().parse_args(shlex.split(decode)[1:])  # the printed command parses as written
    assert (args.target, args.drafter, args.shape) == ("smollm2", "runs/demo/run/best", "auto")
    assert "picks hybrid 2,6,10+lookup 3 here" in text
    serve = next(line for line in lines if "--speculative-config" in line)
    assert serve.startswith("serve it (vLLM drafts chains: chain 2 measured 1.17x here)") and "vllm-env" not in serve


def test_the_verdict_comes_from_the_measurements_not_from_the_expectation():
    """--shape auto expected a shape to pay, but it measured slower: nothing pays; a 1.03x is within the spread."""
    rep = amx_hybrid_pays()
    methods = rep["results"][0]["methods"]
    methods["hybrid 2,6,10+lookup 3"] = row(2.13, 0.97)
    methods["eagle3 tree 2,6,10"] = row(1.69, 1.03)
    methods["eagle3 chain k=2"] = row(1.40, 0.90)
    v = verdict(rep)
    assert not v["pays"] and v["shape"] is None
    assert v["says"][0].startswith("verdict: no drafting shape pays")
    assert "--shape auto expected hybrid 2,6,10+lookup 3 at 1.38x" in v["says"][0]
    assert "verify is cheap here and acceptance is what is missing" in v["says"][1]
    # Another shape measured clearly faster than plain: it pays, and the decode command pins it.
    methods["eagle3 tree 2,6,10"] = row(1.69, 1.20)
    v = verdict(rep)
    assert v["pays"] and v["shape"] == "tree 2,6,10" and v["expected_speedup"] is None
    text = summary_text(result(), rep, "TABLE")
    assert "draftsmith decode --target smollm2 --drafter runs/demo/run/best --tree 2,6,10 --chat" in text


def test_shape_names_map_to_decode_flags_that_parse():
    assert shape_flags("chain 3") == ["--chain", "3"]
    assert shape_flags("tree 2,4,6") == ["--tree", "2,4,6"]
    assert shape_flags("hybrid 2,4,6+lookup 10") == ["--tree", "2,4,6", "--hybrid", "10"]
    flags = shape_flags("hybrid 3,4,8+lookup 6 (n>=2)")
    assert flags == ["--tree", "3,4,8", "--hybrid", "6", "--hybrid-min-ngram", "2"]
    args = build_parser().parse_args(["decode", "--target", "t", "--drafter", "d", "--prompt", "p", *flags])
    assert (args.tree, args.hybrid, args.hybrid_min_ngram) == ("3,4,8", 6, 2)
    assert shape_flags("plain") == []


def test_the_bench_json_carries_the_verify_curve_auto_weighed_and_the_why_reads_it():
    """choose_shape keeps its cost curve in the choice, so bench.json's auto_shape says what a wide pass costs."""
    import json

    from draftsmith.stages.shapes import Acceptance, choose_shape

    weak = Acceptance.from_chain([0.3, 0.2])
    costly = VerifyCost(STEP, {1: STEP, 4: 2 * STEP, 16: 6 * STEP}, {}, {1: STEP / 10})
    choice = choose_shape(weak, costly)
    assert choice.shape is None  # nothing pays at these costs
    auto = json.loads(json.dumps({**choice.to_dict(), "dtype": "dtype bfloat16"}))  # as bench.json stores it
    rep = avx2_nothing_pays()
    rep["auto_shape"] = auto
    v = verdict(rep)
    assert v["wide_pass_steps"] == 6.0 and v["step_ms"] == 40.0
    assert "a 16-token verify pass costs 6.00x a one-token step" in v["says"][1]
    top = max(auto["candidates"], key=auto["candidates"].get)
    assert f"its best candidate, {top}, expected {auto['candidates'][top]:.2f}x" in v["says"][0]


def test_prompt_lookup_that_pays_alone_is_said_when_no_drafting_shape_does():
    rep = avx2_nothing_pays()
    rep["results"][0]["methods"]["prompt lookup k=10"] = row(1.60, 1.25)
    v = verdict(rep)
    assert not v["pays"]
    assert v["says"][0].endswith("Prompt lookup alone pays, with no drafter: prompt lookup k=10 1.25x "
                                 "(`draftsmith decode --prompt-lookup 10`).")
    assert "Prompt lookup alone" not in verdict(avx2_nothing_pays())["says"][0]  # 0.72x: it does not


def test_on_a_gpu_the_why_names_the_gpu_and_sends_nobody_to_a_cpu():
    rep = avx2_nothing_pays()
    rep["device"], rep["machine"]["cuda"] = "cuda:0", "NVIDIA H100 80GB HBM3"
    rep["auto_shape"]["verify_cost"] = curve(0.0)  # a 16-token pass costs a step: acceptance is what is missing
    v = verdict(rep)
    assert "GPU NVIDIA H100 80GB HBM3" in v["says"][1] and "AVX2" not in v["says"][1]
    assert "acceptance is what is missing" in v["says"][1]
    assert "CPU" not in v["says"][2] and "llama.cpp" not in v["says"][2]


def test_a_shape_that_pays_but_loses_to_prompt_lookup_says_so():
    rep = amx_hybrid_pays()
    rep["results"][0]["methods"]["prompt lookup k=10"] = row(2.4, 1.82)
    v = verdict(rep)
    assert v["pays"] and v["over_lookup"] == 1.58 / 1.82
    assert "0.87x prompt lookup (prompt lookup k=10 1.82x, no drafter); prompt lookup alone is faster" in v["says"][0]
    assert v["says"][0].endswith("(`draftsmith decode --prompt-lookup 10`).")
    assert "alone is faster" not in verdict(amx_hybrid_pays())["says"][0]


def test_the_verdict_gives_the_expectations_interval_and_the_table_sets_it_beside_the_measurement():
    """Issue 60: the conservative expectation leads, with its interval over calibration prompts and its point; the
    bench table prints each method's expected tau and speedup next to what it measured."""
    rep = amx_hybrid_pays()
    spread = {"low": 1.38, "point": 1.71, "high": 2.02, "level": 0.9}
    rep["auto_shape"]["expected"] = {"tau": {"low": 2.0, "point": 2.4, "high": 2.9, "level": 0.9},
                                     "speedup": spread}
    rep["expected_from"] = ["calibration on 8 prompts (8 prompts of draftsmith-mixed-v1)"]
    rep["results"][0]["methods"]["hybrid 2,6,10+lookup 3"]["expected"] = rep["auto_shape"]["expected"]
    table = format_table(rep)
    text = summary_text(result(), rep, table)
    assert ("--shape auto expected 1.38x (the low end of 1.38-2.02x over the calibration prompts; point 1.71x)"
            in text.splitlines()[0])
    hybrid = next(line for line in table.splitlines() if "hybrid 2,6,10+lookup 3" in line)
    assert "2.00 (2.40, 2.00-2.90)" in hybrid and "1.38x (1.71, 1.38-2.02)" in hybrid and "2.13" in hybrid
    assert "draftsmith-mixed-v1" in table
