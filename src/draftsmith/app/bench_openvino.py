"""``bench --engine openvino``: the drafter measured in OpenVINO GenAI, against GenAI plain, on the same prompts.

Same prompt sets and chat template as ``bench``, first turns only (a later turn would carry each method's own
answer): each prompt is rendered with the target's chat template and sent as token ids, and every method decodes
it in turn (plain, EAGLE-3 chains at each k, the tree), so machine noise hits them alike. Greedy, f32 compute (in
bf16 GenAI matches itself nowhere token for token). Speed is GenAI's decode rate (generate time less time to first
token, which every method pays alike); tau comes from GenAI's counters (accepted draft tokens over verify passes,
as ``bench --engine llamacpp`` counts them). Every method decodes over an f32 KV cache: over the default f16 trees
give wrong output, over u8 a third of the speculative outputs left plain's (core/openvino_facts.py). The decoding
runs in OpenVINO's own environment (integrations/openvino.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from draftsmith.core import openvino_facts as facts
from draftsmith.core.conventions import ConventionError
from draftsmith.core.errors import UsageError

# bench's flags that only the draftsmith engine uses, with their defaults: refused rather than silently dropped.
UNUSED_FLAGS = (("shape", "--shape", None), ("hybrid", "--hybrid", None), ("prompt_lookup", "--prompt-lookup", "3"),
                ("hybrid_min_ngram", "--hybrid-min-ngram", None), ("readme", "--readme", None),
                ("readme_section", "--readme-section", "bench"), ("dtype", "--dtype", None),
                ("aux_layers", "--aux-layers", None))


def methods_for(ks: Sequence[int], tree: tuple[int, int, int] | None) -> list[dict]:
    out = [{"name": "plain", "mode": "plain"}] + [{"name": f"eagle3 k={k}", "mode": "eagle3", "k": k} for k in ks]
    if tree:
        d, b, n = tree
        out.append({"name": f"eagle3 tree {d},{b},{n}", "mode": "eagle3", "k": n, "tree_depth": d,
                    "branching_factor": b})
    return out


def parse_tree(text: str | None) -> tuple[int, int, int] | None:
    """``DEPTH,TOPK,TOTAL`` (bench's --tree) as GenAI's tree_depth, branching_factor, num_assistant_tokens."""
    if not text:
        return None
    try:
        d, b, n = (int(x) for x in text.split(","))
    except ValueError as e:
        raise UsageError(f"--tree {text}: DEPTH,TOPK,TOTAL (three integers)") from e
    most = b * b * (d - 1) + b
    if d < 1 or b < 1 or not 1 <= n <= most:
        raise UsageError(f"--tree {text}: GenAI needs DEPTH >= 1, TOPK >= 1 and 1 <= TOTAL <= TOPK^2*(DEPTH-1)+TOPK "
                         f"= {most}")
    return d, b, n


def summarize(runs: list[dict], plain: list[dict] | None) -> dict:
    """One method's row from its runs (GenAI's counters), and how many outputs equal plain's."""
    tokens = sum(len(r["tokens"]) for r in runs)
    decode_ms = sum(max(r["generate_ms"] - r["ttft_ms"], 0.0) for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    passes = sum(max(len(r["tokens"]) - 1 - r["accepted"], 1) for r in runs)
    rates = [1000.0 * (len(r["tokens"]) - 1) / (r["generate_ms"] - r["ttft_ms"]) for r in runs
             if r["generate_ms"] > r["ttft_ms"] and len(r["tokens"]) > 1]
    row = {"tokens": tokens, "decode_ms": round(decode_ms, 1),
           "tokens_per_second": round(1000.0 * (tokens - len(runs)) / decode_ms, 2) if decode_ms else 0.0,
           "acceptance_length": round(1 + accepted / passes, 3) if passes else 1.0, "accepted": accepted,
           "ms_per_pass": round(decode_ms / passes, 2) if passes else 0.0,
           "request_tok_s_min": round(min(rates), 2) if rates else 0.0,
           "request_tok_s_median": round(statistics.median(rates), 2) if rates else 0.0}
    if "draft_ms" in runs[0]:
        row["draft_share"] = round(sum(r.get("draft_ms", 0.0) for r in runs) / sum(r["generate_ms"] for r in runs), 3)
    if plain is not None:
        same = sum(a["tokens"] == b["tokens"] for a, b in zip(runs, plain, strict=True))
        row["same_as_plain"] = f"{same}/{len(runs)}"
    return row


def run_openvino_bench(target_ir: str | Path, draft_ir: str | Path, tokenizer, prompt_sets: dict, ks: Sequence[int],
                       tree: tuple[int, int, int] | None = None, max_new_tokens: int = 128, threads: int = 1,
                       kv_cache_precision: str | None = None, progress: bool = True,
                       python: str | Path | None = None) -> dict:
    """Decode every first turn with every method (interleaved) in GenAI; return a JSON-able report."""
    from draftsmith.integrations.openvino import run_worker

    if not ks and not tree:
        raise UsageError("bench --engine openvino needs a --chain/--draft-max k or a --tree")
    try:
        kv = facts.kv_cache_precision(tree is not None, kv_cache_precision)
    except ConventionError as e:
        raise UsageError(str(e)) from e
    methods = methods_for(ks, tree)
    report = {"engine": "openvino", "target": str(target_ir), "drafter": str(draft_ir), "threads": threads,
              "max_new_tokens": max_new_tokens, "inference_precision": facts.INFERENCE_PRECISION,
              "kv_cache_precision": kv, "results": []}
    eos = [t for t in [tokenizer.eos_token_id] if t is not None]
    for dataset, prompts in prompt_sets.items():
        ids = []
        for p in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}], add_generation_prompt=True,
                                                 tokenize=False)
            ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        answer = run_worker({"op": "decode", "target": str(target_ir), "draft": str(draft_ir), "prompts": ids,
                             "methods": methods, "max_new_tokens": max_new_tokens, "eos": eos, "threads": threads,
                             "inference_precision": facts.INFERENCE_PRECISION, "kv_cache_precision": kv,
                             "progress": progress}, python=python, progress=progress)
        runs = answer["runs"]
        rows = {m["name"]: summarize(runs[m["name"]], None if m["mode"] == "plain" else runs["plain"])
                for m in methods}
        plain = rows["plain"]["tokens_per_second"]
        for row in rows.values():
            row["speedup"] = round(row["tokens_per_second"] / plain, 3) if plain else 0.0
        report["versions"] = answer.get("versions", {})
        report["results"].append({"dataset": dataset, "prompts": len(prompts), "methods": rows})
    return report


def format_openvino_table(report: dict) -> str:
    v = report.get("versions", {})
    lines = [f"OpenVINO GenAI {v.get('openvino-genai', '?')} on {report['target']}, {report['threads']} thread(s), "
             f"greedy, {report['inference_precision']} compute, {report['kv_cache_precision']} KV cache, "
             f"{report['max_new_tokens']} new tokens, first turns"]
    for res in report["results"]:
        lines.append(f"{res['dataset']} ({res['prompts']} prompts)")
        lines.append(f"  {'method':<20} {'tok/s':>7} {'min':>6} {'median':>7} {'speedup':>7} {'tau':>5} "
                     f"{'ms/pass':>7} {'draft':>6} {'same':>6}")
        for name, m in res["methods"].items():
            share = f"{100 * m['draft_share']:.0f}%" if "draft_share" in m else "-"
            lines.append(f"  {name:<20} {m['tokens_per_second']:7.1f} {m['request_tok_s_min']:6.1f} "
                         f"{m['request_tok_s_median']:7.1f} {m['speedup']:6.2f}x {m['acceptance_length']:5.2f} "
                         f"{m['ms_per_pass']:7.1f} {share:>6} {m.get('same_as_plain', '-'):>6}")
    return "\n".join(lines)


def check_openvino_args(args) -> tuple[list[int], tuple[int, int, int] | None]:
    """The chain lengths and tree to measure, after refusing what this engine cannot honour."""
    from draftsmith.app.args import parse_ints

    given = [flag for dest, flag, default in UNUSED_FLAGS if getattr(args, dest, default) not in (default, 0, "0")]
    if getattr(args, "device", None) not in (None, "auto", "cpu"):
        given.append("--device")
    if given:
        raise UsageError(f"bench --engine openvino does not use {', '.join(given)} (the draftsmith engine's); drop "
                         f"{'them' if len(given) > 1 else 'it'}")
    if args.draft_max is not None and args.chain is not None:
        raise UsageError("bench --engine openvino: give --draft-max (its chain lengths) or --chain, not both")
    tree = parse_tree(args.tree)
    ks = parse_ints(args.draft_max) or ([args.chain] if args.chain else [] if tree else [3])
    for k in ks:
        if not 1 <= k <= 16:
            raise UsageError(f"--draft-max {k}: GenAI's num_assistant_tokens, 1..16 here")
    if args.threads < 1:
        raise UsageError(f"--threads takes a number >= 1, got {args.threads}")
    if args.temperature not in ("0", "0.0"):
        raise UsageError("bench --engine openvino measures greedy decoding only (--temperature 0)")
    out = Path(args.out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UsageError(f"--out {args.out}: {blocker} exists and is not a directory")
    return ks, tree


def check_openvino_pair(target: str | Path, drafter: str | Path) -> None:
    """doctor --engine openvino's errors end the run in one line, before anything is converted."""
    from draftsmith.stages.doctor.openvino_checks import diagnose_openvino

    errors = [f for f in diagnose_openvino(target, drafter).findings if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UsageError(f"OpenVINO GenAI cannot serve this pair faithfully: {errors[0].id}: {errors[0].message}"
                         f"{more}; doctor --engine openvino --target {target} --drafter {drafter} says more")


def bench_openvino_command(args) -> int:
    """The CLI's ``bench --engine openvino``: check, convert what is not an IR yet, measure, write the report."""
    from transformers import AutoTokenizer

    from draftsmith.app.bench import check_bench_args, warn_leaks
    from draftsmith.core.io import atomic_write
    from draftsmith.integrations.openvino import OpenVinoError, openvino_python
    from draftsmith.stages.export.openvino import export_openvino, openvino_target, target_source_dir

    ks, tree = check_openvino_args(args)
    try:
        python = openvino_python(getattr(args, "openvino_python", None))
    except OpenVinoError as e:
        raise UsageError(str(e)) from e
    prompt_sets = check_bench_args([d for d in args.datasets.split(",") if d], [0.0], limit=args.limit, turns=1,
                                   max_new_tokens=args.max_new_tokens, prompt_lookup_ks=[])
    check_openvino_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_source_dir(args.target))
    leaked = warn_leaks(prompt_sets, args.train_conversations)
    weights = getattr(args, "openvino_weights", "fp32")
    try:
        target_ir = openvino_target(args.target, weights, python=python)
        with tempfile.TemporaryDirectory(prefix="draftsmith-ov-") as tmp:
            draft = Path(args.drafter)
            if not (draft / facts.DRAFT_XML).is_file():
                draft = export_openvino(draft, Path(tmp) / "draft", target=args.target, python=python).path
            report = run_openvino_bench(target_ir, draft, tokenizer, prompt_sets, ks, tree, args.max_new_tokens,
                                        args.threads, progress=args.progress, python=python)
    except OpenVinoError as e:
        raise UsageError(str(e)) from e
    report["target_weights"] = weights
    report.update({"leaked_prompts": leaked} if leaked else {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_openvino_table(report)
    atomic_write(out / "bench-openvino.json", json.dumps(report, indent=1).encode())
    atomic_write(out / "bench-openvino.txt", (table + "\n").encode())
    print(json.dumps(report) if args.json else table)
    print(f"wrote {out / 'bench-openvino.json'}, {out / 'bench-openvino.txt'}", file=sys.stderr)
    return 0
