"""Training-recipe levers on one feature store: held-out simulated tau after the same number of steps.

Each variant is `name=JSON` of TrainConfig overrides on a base config (a run's own config.json, or the
demo's defaults); every variant trains from scratch on the same store, split and seed, one after another
(run it on a quiet machine: the wall times are compared too). The table gives the held-out simulated
acceptance length at each evaluation, the best, and the training wall time.

Run:
  python bench/recipe_levers.py --store runs/demo/store --base runs/demo/run/config.json \\
      --variant 'random head={"init_head": false}' --variant 'target head={"init_head": true}' \\
      --out runs/levers [--json runs/levers/levers.json]
Variants already trained in --out are read back, not retrained (delete a variant's folder to redo it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from draftsmith.core.allocator import keep_freed_memory
from draftsmith.stages.train.config import load_config
from draftsmith.stages.train.run import train


def parse_variant(text: str) -> tuple[str, dict]:
    name, sep, overrides = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"recipe_levers: error: --variant wants NAME=JSON, got {text!r}")
    try:
        values = json.loads(overrides)
    except json.JSONDecodeError as e:
        raise SystemExit(f"recipe_levers: error: --variant {name}: not JSON ({e})") from e
    if not isinstance(values, dict):
        raise SystemExit(f"recipe_levers: error: --variant {name}: overrides must be a JSON object")
    return name.strip(), values


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("eval")]


def run_variant(base: dict, name: str, overrides: dict, out: Path) -> dict:
    run_dir = out / re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    timing = run_dir / "wall.json"
    if not timing.is_file():
        cfg = load_config(None, {**base, **overrides, "out": str(run_dir), "resume": False, "plot": False})
        t0 = time.perf_counter()
        train(cfg)
        timing.write_text(json.dumps({"train_s": time.perf_counter() - t0}))
    rows = evals(run_dir)
    return {"name": name, "overrides": overrides, "train_s": json.loads(timing.read_text())["train_s"],
            "evals": {r["step"]: r["simulated_tau"] for r in rows},
            "best": max((r["simulated_tau"] for r in rows), default=None),
            "acc": [rows[-1][k] for k in sorted(rows[-1]) if k.startswith("eval_acc_")] if rows else []}


def table(results: list[dict]) -> str:
    steps = sorted({s for r in results for s in r["evals"]})
    head = f"{'variant':<24}" + "".join(f"{'@' + str(s):>8}" for s in steps) + f"{'best':>8}{'train s':>9}  acc"
    lines = [head]
    for r in results:
        cells = "".join(f"{r['evals'][s]:>8.3f}" if s in r["evals"] else f"{'':>8}" for s in steps)
        acc = " ".join(f"{a:.3f}" for a in r["acc"])
        lines.append(f"{r['name']:<24}{cells}{r['best']:>8.3f}{r['train_s']:>9.0f}  {acc}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a feature store written by `draftsmith capture`")
    ap.add_argument("--base", default=None, help="a run's config.json to start from (default: TrainConfig's)")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=JSON")
    ap.add_argument("--out", required=True, help="one run folder per variant goes here")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    keep_freed_memory()  # train as `draftsmith train` does
    base = json.loads(Path(args.base).read_text()) if args.base else {}
    base = {k: v for k, v in base.items() if v is not None}
    base.update(store=args.store, conversations=None, progress=False)
    base.pop("conversations")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for text in args.variant:
        name, overrides = parse_variant(text)
        results.append(run_variant(base, name, overrides, out))
        print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
