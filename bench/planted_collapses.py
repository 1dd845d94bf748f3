"""Issue 52: plant each known silent fault into a good export of a fitted drafter, and record what the engine does
(refuses, crashes, or serves at what acceptance) and what doctor and ``draftsmith check`` say.

    PYTHONPATH=src .venv/bin/python bench/planted_collapses.py --out runs/planted [--reference]
    PYTHONPATH=src .venv/bin/python bench/planted_collapses.py --engine openvino --out runs/planted-ov

The pair: SmolLM2-135M and a drafter fitted to its greedy continuations (``testing.planted``); for llama.cpp the
target as an F32 GGUF and the drafter's fp32 GGUF, for OpenVINO GenAI both as fp32 IRs (``testing.planted_openvino``:
the faults its converter and loader accept; the reference decode in draftsmith always runs there).
Each case runs ``check`` in its own process (llama.cpp aborts the process on some malformed drafters).
``--reference`` also decodes in draftsmith and replays the faulty readings (slow on a loaded CPU).
Writes planted.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHECK = """
import json, sys
from draftsmith.stages.check import CheckOptions, run_check
job = json.loads(sys.argv[1])
r = run_check(CheckOptions(**job))
print("CHECK " + json.dumps(r.to_dict()), flush=True)
"""


def run_case(job: dict, timeout: float = 1800) -> dict:
    try:
        p = subprocess.run([sys.executable, "-c", CHECK, json.dumps(job)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("CHECK ")), None)
    if line is None:
        tail = " ".join((p.stderr or p.stdout).split()[-40:])
        return {"engine": f"crashed (exit {p.returncode}): {tail[-300:]}", "exit_code": p.returncode}
    return json.loads(line[6:])


def engine_outcome(r: dict) -> str:
    if "verdict" not in r:
        return r["engine"]
    if r["verdict"] == "refused by doctor":
        return "not run (doctor blocks)"
    if r["verdict"] == "engine refused":
        return "refused: " + "; ".join(r["notes"])[-200:]
    eq = r.get("equality") or {}
    return f"served, tau {r['served_tau']:.2f}, output equal {eq.get('identical')}/{eq.get('compared')}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/planted")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated subset of good and the engine's faults")
    ap.add_argument("--engine", choices=["llamacpp", "openvino"], default="llamacpp")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="openvino: skip the replays of faulty readings (the card and doctor name these faults)")
    args = ap.parse_args()
    if args.engine == "openvino":
        return report(openvino_rows(Path(args.out), args.cases, args.replay), Path(args.out), "OpenVINO GenAI")
    from draftsmith.testing.planted import GGUF_FAULTS, llamacpp_world, plant_gguf

    out = Path(args.out)
    world = llamacpp_world(out / "world")
    cases = {"good": world["good"]}
    for fault in GGUF_FAULTS:
        cases[fault] = plant_gguf(world["good"], out / "planted" / fault, fault)
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    rows = {}
    for name, gguf in cases.items():
        job = {"engine": "llamacpp", "target": str(world["target_gguf"]), "drafter": str(gguf),
               "prompts": world["prompts"], "k": 3, "max_new_tokens": world["new_tokens"],
               "draftsmith_target": "smollm2", "force": True,
               "reference_drafter": str(world["drafter_dir"]) if args.reference else None}
        rows[name] = run_case(job)
        print(name, json.dumps(rows[name])[:400], file=sys.stderr, flush=True)
    return report(rows, out, "llama.cpp")


def openvino_rows(out: Path, cases: str | None, replay: bool = True) -> dict:
    """Each OpenVINO fault planted and checked (the reference drafter: the one the IR was converted from)."""
    from draftsmith.testing.planted_openvino import OPENVINO_FAULTS, openvino_world, plant_openvino

    world = openvino_world(out / "world")
    rows = {}
    for name in ("good", *OPENVINO_FAULTS):
        if cases and name not in cases.split(","):
            continue
        done = out / "planted" / name
        try:
            if name == "good":
                ir = world["good"]
            elif (done / "drafter_card.json").is_file() and (done / "openvino_model.xml").is_file():
                ir = done  # converted by an earlier run
            else:
                ir = plant_openvino(world, done, name)
        except Exception as e:  # noqa: BLE001 - the converter refusing the fault is a row of the table
            rows[name] = {"engine": f"not converted: {' '.join(str(e).split())[:300]}"}
            continue
        ref = world["nbr_drafter_dir"] if name == "norm-before-residual" else world["drafter_dir"]
        job = {"engine": "openvino", "target": "smollm2", "drafter": str(ir), "prompts": world["prompts"], "k": 3,
               "max_new_tokens": world["new_tokens"], "draftsmith_target": "smollm2", "force": True,
               "reference_drafter": str(ref), "replay": replay}
        rows[name] = run_case(job, timeout=900)
        (out / "planted.partial.json").write_text(json.dumps(rows, indent=1))  # a long run keeps what it has
        print(name, json.dumps(rows[name])[:400], file=sys.stderr, flush=True)
    return rows


def report(rows: dict, out: Path, engine: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "planted.json").write_text(json.dumps(rows, indent=1))
    print(f"| case | {engine} | doctor | check verdict | cause named |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        causes = ", ".join(sorted({f["cause"] for f in r.get("findings", [])})) or "-"
        doctor = "blocks" if r.get("doctor_blocking") else "passes"
        print(f"| {name} | {engine_outcome(r)} | {doctor} | {r.get('verdict', '-')} (exit {r.get('exit_code')}) "
              f"| {causes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
