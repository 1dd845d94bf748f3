"""What the demo found, said first: whether a drafting shape pays on this machine, why, and how to use the drafter.

The verdict is read from the bench's numbers: the speedups it measured over plain decoding and over prompt
lookup, `--shape auto`'s choice with its expected speedup and the verify curve it weighed shapes on. A shape
pays only where it measured faster than plain decoding by more than a bench's run-to-run spread; the serve
line is a recommendation only where the chain vLLM would draft measured so too.
"""

from __future__ import annotations

import re
import shlex
import statistics
from pathlib import Path

from draftsmith.stages.verify_cost import VerifyCost

#: A speedup at or under this is not called paying: CPU benches of the same drafter move several percent
#: between runs, and a second model is not worth less.
PAYS_OVER = 1.05
#: The verify pass the "why" quotes: a 2-deep tree with a grafted lookup verifies about this many tokens.
WIDE_PASS = 16
#: Above this many steps for a WIDE_PASS-token pass, verify cost is what keeps speculation from paying; under
#: it, acceptance is (the verify pass is nearly free, as where decoding is bound by reading the weights).
COSTLY_PASS = 2.0
DECODE_PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
DRAFTER_ROWS = ("eagle3 ", "hybrid ")
LOOKUP_ROWS = "prompt lookup"


def bench_row(shape: str) -> str:
    """The bench table's row name of a `--shape auto` shape name ('chain 2' -> 'eagle3 chain k=2')."""
    if shape.startswith("chain "):
        return f"eagle3 chain k={shape.removeprefix('chain ')}"
    if shape.startswith("tree "):
        return f"eagle3 {shape}"
    return shape  # hybrids are spelled alike; 'plain' is plain


def shape_of_row(row: str) -> str:
    """The inverse of ``bench_row``: the name `--shape auto` and the decode flags use."""
    if row.startswith("eagle3 chain k="):
        return f"chain {row.removeprefix('eagle3 chain k=')}"
    return row.removeprefix("eagle3 ")


def on_gpu(report: dict) -> bool:
    """Whether the bench decoded on a GPU (its report names the device; older reports ran on the CPU)."""
    return str(report.get("device", "cpu")).startswith("cuda")


def hardware_kind(report: dict) -> tuple[str, str]:
    """(what this machine is, what that means for a wide verify pass): the GPU, or the CPU's bf16 / matrix units."""
    machine = report.get("machine", {})
    if on_gpu(report):
        gpu = machine.get("cuda") or report["device"]
        return f"GPU {gpu}", "a few-token pass is bound by reading the weights, like a step"
    flags = set(machine.get("flags") or ())
    cpu = machine.get("cpu") or "this CPU"
    if "amx_bf16" in flags:
        return f"{cpu}: AMX", "AMX's bf16 tiles keep a wide pass near one step"
    if "avx512_bf16" in flags:
        return f"{cpu}: AVX-512 bf16, no AMX", "bf16 dot products are native, without AMX's tiles"
    if "avx512f" in flags:
        return f"{cpu}: AVX-512 without bf16", "bf16 is emulated, so a wide pass is compute-bound"
    if "avx2" in flags:
        return f"{cpu}: AVX2 only, no AVX-512 or AMX", "bf16 is emulated, so a wide pass is compute-bound"
    return f"{cpu}: no AVX2", "a wide pass is compute-bound"


def shape_flags(shape: str) -> list[str]:
    """decode's flags for a shape name ('hybrid 2,4,6+lookup 3 (n>=2)' -> --tree 2,4,6 --hybrid 3 ...)."""
    if m := re.fullmatch(r"chain (\d+)", shape):
        return ["--chain", m[1]]
    if m := re.fullmatch(r"tree ([\d,]+)", shape):
        return ["--tree", m[1]]
    if m := re.fullmatch(r"hybrid ([\d,]+)\+lookup (\d+)(?: \(n(?:>=| )(\d+)[^)]*\))?", shape):
        return ["--tree", m[1], "--hybrid", m[2], *(["--hybrid-min-ngram", m[3]] if m[3] else [])]
    return []


def measured_speedups(report: dict) -> tuple[dict[str, float], list[str]]:
    """Each method's speedup over plain decoding, the mean over the bench's datasets; and those datasets."""
    runs: dict[str, list[float]] = {}
    for res in report.get("results", []):
        for name, m in res["methods"].items():
            runs.setdefault(name, []).append(float(m["speedup"]))
    return ({name: statistics.fmean(v) for name, v in runs.items()},
            list(dict.fromkeys(r["dataset"] for r in report.get("results", []))))


def round_cost(report: dict, row: str) -> tuple[float, float] | None:
    """(tau, plain steps a round costs) of a method, from the bench's own timings: tau / its speedup bound."""
    for res in report.get("results", []):
        m = res["methods"].get(row)
        if m and m.get("speedup_bound"):
            return float(m["acceptance_length"]), float(m["acceptance_length"]) / float(m["speedup_bound"])
    return None


def wide_pass_steps(auto: dict) -> tuple[float, float] | None:
    """(a WIDE_PASS-token verify pass in one-token steps, a step's seconds) on the curve `--shape auto` measured."""
    try:
        cost = VerifyCost.from_dict(auto["verify_cost"])
    except (KeyError, TypeError, ValueError):
        return None
    return (cost.t_verify(WIDE_PASS) / cost.t_step, cost.t_step) if cost.t_step > 0 else None


def verdict(report: dict) -> dict:
    """Whether and what pays on this machine, from the bench report's numbers; ``says`` holds the lines to print
    (the verdict, why, and where it would pay instead when nothing does here)."""
    speed, datasets = measured_speedups(report)
    auto = report.get("auto_shape") or {}
    drafted = {n: s for n, s in speed.items() if n.startswith(DRAFTER_ROWS)}
    lookups = {n: s for n, s in speed.items() if n.startswith(LOOKUP_ROWS)}
    lookup = max(lookups, key=lookups.get, default=None)
    best = max(drafted, key=drafted.get, default=None)
    auto_row = bench_row(auto["shape"]) if auto.get("shape", "plain") != "plain" else None
    # What `--shape auto` picks where it measured paying too, else whatever measured fastest.
    row = auto_row if auto_row in drafted and drafted[auto_row] > PAYS_OVER else best
    pays = row is not None and drafted[row] > PAYS_OVER
    hardware, pass_note = hardware_kind(report)
    v = {"pays": pays, "shape": shape_of_row(row) if pays else None, "method": row if pays else None,
         "measured_speedup": drafted[row] if pays else None,
         "expected_speedup": auto.get("expected_speedup") if pays and row == auto_row else None,
         "over_lookup": drafted[row] / lookups[lookup] if pays and lookup and lookups[lookup] else None,
         "lookup": lookup, "lookup_speedup": lookups.get(lookup),
         "best_drafted": best, "best_drafted_speedup": drafted.get(best),
         "auto_shape": auto.get("shape"), "auto_expected_speedup": auto.get("expected_speedup"),
         "hardware": hardware, "dtype": report.get("dtype"), "measured": speed, "datasets": datasets}
    wide, step_s = wide_pass_steps(auto) or (None, None)
    v.update(wide_pass_steps=wide, step_ms=step_s * 1e3 if step_s else None)
    on = f"on {', '.join(datasets)}" if len(datasets) < 2 else f"mean of {', '.join(datasets)}"
    where = f"on this machine ({hardware})" + (f", in {v['dtype']}," if v["dtype"] else "")
    cost = f"a {WIDE_PASS}-token verify pass costs {wide:.2f}x a one-token step of {v['step_ms']:.1f} ms" if wide \
        else None
    tau_steps = round_cost(report, row) if row else None
    if pays:
        because = [*([cost] if cost else []), *([f"{v['shape']} accepts tau {tau_steps[0]:.2f} tokens a round that "
                                                f"costs {tau_steps[1]:.2f} plain steps"] if tau_steps else [])]
        v["says"] = [_pays_line(v, auto, on), f"why: {where} " + ("; ".join(because) or "no timing was recorded") + "."]
        return v
    tried = ", ".join(f"{shape_of_row(n)} {s:.2f}x" for n, s in [*drafted.items(), *lookups.items()])
    because = []
    if cost:
        because.append(cost + (f" ({pass_note}): verify cost is what is missing" if wide > COSTLY_PASS else
                               ", so verify is cheap here and acceptance is what is missing: train longer or on "
                               "more data (--preset full)"))
    if tau_steps:
        because.append(f"{shape_of_row(best)} accepts tau {tau_steps[0]:.2f} tokens a round that costs "
                       f"{tau_steps[1]:.2f} plain steps, so it needs tau > {tau_steps[1]:.2f} to break even")
    free = (f" Prompt lookup alone pays, with no drafter: {lookup} {lookups[lookup]:.2f}x{_lookup_decode(lookup)}."
            if lookup and lookups[lookup] > PAYS_OVER else "")
    v["says"] = [f"verdict: no drafting shape pays on this machine ({_auto_said(auto, drafted)}); measured {on}: "
                 f"{tried or 'nothing'}.{free}",
                 f"why: {where} " + ("; ".join(because) or "no timing was recorded") + ".", where_instead(report)]
    return v


def _auto_said(auto: dict, drafted: dict[str, float]) -> str:
    """What `--shape auto` expected, and, where its shape was benched, what that measured."""
    if not auto:
        return "--shape auto was not run"
    if auto.get("shape", "plain") == "plain":
        candidates = auto.get("candidates") or {}
        top = max(candidates, key=candidates.get, default=None)
        return "--shape auto chose plain decoding" + (
            f": its best candidate, {top}, expected {candidates[top]:.2f}x" if top else "")
    measured = drafted.get(bench_row(auto["shape"]))
    return (f"--shape auto expected {auto['shape']} at {expected_text(auto)}"
            + (f", measured {measured:.2f}x" if measured is not None else ""))


def expected_text(auto: dict) -> str:
    """'1.52x (the low end of 1.52-2.10x over the calibration prompts; point 1.80x)', or '1.52x' where `--shape
    auto` gave no interval (an older report)."""
    speed = (auto.get("expected") or {}).get("speedup") or {}
    head = f"{auto['expected_speedup']:.2f}x"
    if not speed or speed.get("low") == speed.get("high"):
        return head
    return (f"{head} (the low end of {speed['low']:.2f}-{speed['high']:.2f}x over the calibration prompts; point "
            f"{speed['point']:.2f}x)")


def _lookup_decode(row: str) -> str:
    """' (`draftsmith decode --prompt-lookup K`)' for a bench row 'prompt lookup k=K', '' for anything else."""
    k = re.search(r"k=(\d+)", row)
    return f" (`draftsmith decode --prompt-lookup {k[1]}`)" if k else ""


def _pays_line(v: dict, auto: dict, on: str) -> str:
    expected = (f"--shape auto expected {expected_text(auto)}" if v["expected_speedup"] is not None
                else _auto_said(auto, v["measured"]))
    over = (f", {v['over_lookup']:.2f}x prompt lookup ({v['lookup']} {v['lookup_speedup']:.2f}x, no drafter)"
            if v["over_lookup"] else "")
    if v["over_lookup"] and v["over_lookup"] < 1:
        over += "; prompt lookup alone is faster here, with no drafter" + _lookup_decode(v["lookup"])
    return (f"verdict: {v['shape']} pays on this machine: {v['measured_speedup']:.2f}x plain decoding measured "
            f"({on}; {expected}){over}.")


def where_instead(report: dict) -> str:
    """Where a drafter that does not pay here would: where a verify pass costs about one step."""
    places = ["a GPU engine, where decoding is bound by reading the weights and a few-token verify pass costs about "
              "one step (export + vllm serve, below)"]
    if not on_gpu(report):
        if "amx_bf16" not in (report.get("machine", {}).get("flags") or ()):
            places.append("a CPU with AMX, whose bf16 tiles keep a wide verify pass near one step")
        places.append("a larger target, whose step is bound by reading its weights so a short chain verifies "
                      "nearly free (also in llama.cpp, which drafts chains)")
    return "where it would pay instead: " + "; ".join(places) + "."


def use_lines(result: dict, v: dict) -> list[str]:
    """The commands that use the drafter: decode with the shape that pays, then export + vllm serve."""
    decode = shlex.join(["draftsmith", "decode", "--target", str(result["target"]), "--drafter",
                         str(result["drafter"]), "--shape", "auto", "--chat", "--prompt", DECODE_PROMPT])
    auto = v.get("auto_shape")
    picks = f"picks {'plain decoding' if auto == 'plain' else auto} here" if auto else "picks the shape that pays"
    if auto and auto != "plain" and bench_row(auto) in v["measured"]:
        picks += f", which measured {v['measured'][bench_row(auto)]:.2f}x"
    lines = ["use it:", f"  {decode}", f"  (--shape auto measures this machine again and {picks})"]
    if v["pays"] and v["shape"] != auto and shape_flags(v["shape"]):
        pinned = decode.replace("--shape auto", shlex.join(shape_flags(v["shape"])))
        lines += [f"  {pinned}", f"  (the shape that measured fastest here, {v['shape']}, pinned)"]
    k = (result.get("settings") or {}).get("chain")
    serves = v["measured"].get(f"eagle3 chain k={k}")
    lines.append(f"  exported for vLLM: {result['export']} (`draftsmith export --drafter {result['drafter']} "
                 f"--format vllm --out {result['export']} --force`)")
    env = "" if result.get("vllm_env", True) else "; `make vllm-env` first, which installs vLLM into .venv-vllm"
    if serves is not None and serves > PAYS_OVER:
        lines.append(f"serve it (vLLM drafts chains: chain {k} measured {serves:.2f}x here{env}): "
                     f"{result['vllm_serve']}")
    else:
        measured = f"measured {serves:.2f}x on this machine" if serves is not None else "not measured here"
        env = "" if result.get("vllm_env", True) else "; to try it here anyway, `make vllm-env` first"
        lines.append(f"to serve on a GPU engine (not here: chain {k}, which vLLM would draft, {measured}{env}): "
                     f"{result['vllm_serve']}")
    return lines


def llamacpp_numbers(report: dict, k: int) -> dict:
    """The llama.cpp bench's headline at its fastest EAGLE-3 k (the chain ``k`` when none was measured): each
    method's tok/s (mean over the datasets), EAGLE-3's tau, speedup over plain and break-even tau (the
    profile's), whether it pays (over plain by PAYS_OVER), and that ``k``. The n-gram row is the one at ``k``."""
    rows = [res["methods"] for res in report.get("results", [])]
    ngram = f"ngram k={k}"

    def mean(name: str, key: str) -> float | None:
        vals = [float(r[name][key]) for r in rows if name in r and r[name].get(key) is not None]
        return statistics.fmean(vals) if vals else None

    measured = sorted({int(n.split("=")[1]) for r in rows for n in r if n.startswith("eagle3 k=")})
    k_best = max(measured, key=lambda kk: mean(f"eagle3 k={kk}", "speedup") or 0.0) if measured else k
    eagle, k = f"eagle3 k={k_best}", k_best

    evens = [float(p[f"k={k}"]["break_even_tau"]) for res in report.get("results", [])
             if (p := res.get("profile") or {}).get(f"k={k}", {}).get("break_even_tau") is not None]
    speedup = mean(eagle, "speedup")
    return {"plain_tok_s": mean("plain", "tokens_per_second"), "eagle3_tok_s": mean(eagle, "tokens_per_second"),
            "tau": mean(eagle, "acceptance_length"), "ngram_tok_s": mean(ngram, "tokens_per_second"),
            "eagle3_speedup": speedup, "break_even_tau": statistics.fmean(evens) if evens else None,
            "pays": speedup is not None and speedup > PAYS_OVER, "k": k}


def llamacpp_lines(outcome: dict | None) -> list[str]:
    """The llama.cpp line (plain, EAGLE-3 at its fastest k, n-gram: pays or not) and its GGUF export command;
    nothing where llama.cpp was not asked for or not installed."""
    if not outcome:
        return []
    head = "llama.cpp (CPU engine users run): "
    export = [f"  export for llama.cpp (--model-draft): {outcome['export_command']}"] \
        if outcome.get("export_command") else []
    if "skipped" in outcome or outcome.get("eagle3_tok_s") is None:
        return [head + "not measured: " + outcome.get("skipped", "its report holds no EAGLE-3 row"), *export]
    k, n = outcome["k"], outcome
    fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
    if n["pays"]:
        why = f"pays here ({n['eagle3_speedup']:.2f}x plain" + (
            "; n-gram lookup is faster, with no drafter)" if (n["ngram_tok_s"] or 0) > n["eagle3_tok_s"] else ")")
    else:
        why = f"does not pay here ({n['eagle3_speedup']:.2f}x plain" + (
            f"; a round costs {n['break_even_tau']:.2f} plain steps, so it pays above tau {n['break_even_tau']:.2f})"
            if n.get("break_even_tau") else ")")
    line = (f"{head}plain {fmt(n['plain_tok_s'])} tok/s, EAGLE-3 k={k} {fmt(n['eagle3_tok_s'])} tok/s "
            f"(tau {n['tau']:.2f}), n-gram {fmt(n['ngram_tok_s'])} tok/s — {why}")
    return [line, *export]


def summary_text(result: dict, report: dict, table: str) -> str:
    """The demo's closing text: the verdict first, then the bench table, then how to use the drafter."""
    v = result.get("verdict") or verdict(report)
    lines = [*v["says"], "", table.rstrip(), "", f"drafter:  {result['drafter']}"]
    if result.get("simulated_acceptance_length"):
        lines.append(f"simulated acceptance length at training time: {result['simulated_acceptance_length']:.2f}")
    lines += use_lines(result, v)
    lines += llamacpp_lines(result.get("llamacpp"))
    every = result["seconds_all_sessions"]
    earlier = (f" ({every['total'] / 60:.1f} over the workdir's {every['sessions']} sessions)"
               if every["sessions"] > 1 else "")
    summary = Path(result["workdir"]) / "summary.json"
    lines.append(f"total {result['seconds']['total'] / 60:.1f} min{earlier}; summary: {summary}")
    return "\n".join(lines)


def print_summary(result: dict, report: dict, table: str) -> None:
    print("\n" + summary_text(result, report, table))
