"""Data-scaling curve: held-out and MT-bench acceptance against the number of training conversations.

Every point trains the same recipe (a run's config.json, same steps) on the first N training conversations
of one store (``train_samples``: nested random subsets by id hash; the held-out split is the same for all),
then ``draftsmith bench`` decodes MT-bench first turns with a chain of ``--chain`` drafts (T=0, so tau is
exact, not a timing). Writes a JSON and a PNG (tau against conversations, log scale).

Run:
  python bench/scaling_curve.py --store runs/demo/store --base runs/demo/run/config.json \\
      --samples 80,160,320,0 --out runs/scaling [--chain 2 --limit 8 --max-new-tokens 192 --dtype bfloat16]
``0`` means every training conversation. Points already trained or benched in --out are read back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_levers import run_variant  # noqa: E402

from draftsmith.core.allocator import keep_freed_memory  # noqa: E402
from draftsmith.data.store import FeatureStore  # noqa: E402
from draftsmith.stages.train.data import first_samples, split_eval  # noqa: E402


def bench_tau(drafter: Path, out: Path, args: argparse.Namespace) -> float:
    report = out / "bench.json"
    if not report.is_file():
        cmd = [sys.executable, "-m", "draftsmith.cli", "bench", "--target", args.target, "--dtype", args.dtype,
               "--drafter", str(drafter), "--datasets", args.datasets, "--limit", str(args.limit), "--turns", "1",
               "--max-new-tokens", str(args.max_new_tokens), "--chain", str(args.chain), "--prompt-lookup", "0",
               "--out", str(out), "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    methods = json.loads(report.read_text())["results"][0]["methods"]
    return methods[f"eagle3 chain k={args.chain}"]["acceptance_length"]


def plot(points: list[dict], path: Path, chain: int, steps: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(points, key=lambda p: p["conversations"])
    xs = [p["conversations"] for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [p["held_out_tau"] for p in points], "o-", label="held-out simulated tau (2 drafts)")
    ax.plot(xs, [p["mt_bench_tau"] for p in points], "s-", label=f"MT-bench tau, chain {chain}")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations")
    ax.set_ylabel("acceptance length (tau)")
    ax.grid(alpha=0.3)
    ax.legend(title=f"{steps:,} training steps each" if steps else None)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--base", required=True, help="a run's config.json (the recipe every point trains)")
    ap.add_argument("--samples", default="80,160,320,0", help="comma-separated conversation counts; 0: all")
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--datasets", default="mt-bench")
    ap.add_argument("--chain", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    args = ap.parse_args(argv)
    keep_freed_memory()  # train as `draftsmith train` does
    base = {k: v for k, v in json.loads(Path(args.base).read_text()).items() if v is not None}
    base.update(store=args.store, progress=False)
    base.pop("conversations", None)
    store = FeatureStore(args.store, verify_on_open=False)
    train_idx, _ = split_eval(list(store.sample_ids), float(base.get("eval_fraction", 0.05)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = []
    for n in (int(x) for x in args.samples.split(",")):
        used = len(first_samples(list(store.sample_ids), train_idx, n))
        r = run_variant(base, f"n{used}", {"train_samples": n}, out)
        tau = bench_tau(out / f"n{used}" / "best", out / f"n{used}" / "bench", args)
        points.append({"conversations": used, "held_out_tau": r["best"], "mt_bench_tau": tau,
                       "train_s": r["train_s"]})
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    (out / "scaling.json").write_text(json.dumps(points, indent=2))
    plot(points, out / "scaling.png", args.chain, base.get("max_steps"))
    print(f"{'conversations':>14}{'held-out tau':>14}{'MT-bench tau':>14}")
    for p in points:
        print(f"{p['conversations']:>14}{p['held_out_tau']:>14.3f}{p['mt_bench_tau']:>14.3f}")
    print(f"wrote {out / 'scaling.json'}, {out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
