"""Benchmark the fp8 feature store: bytes per token and its effect on trained acceptance, bf16 vs fp8.

    OMP_NUM_THREADS=1 python bench/bench_fp8.py                       # tiny random target, a few minutes
    OMP_NUM_THREADS=1 python bench/bench_fp8.py --target smollm2 \\
        --conversations runs/demo/conversations.jsonl --max-steps 150 --seeds 0,1

For one target, over one conversations file (self-generated for ``--target tiny``: the tiny target's own
greedy answers to random word questions, as tests/conftest.py does):

1. Split the conversations by a hash of their id into a training set and ``--held-out`` conversations
   that are never captured nor trained on (the file is snapshotted first: another process may be writing it).
2. Capture the training set twice with ``draftsmith.stages.capture``, ``CaptureConfig(dtype="bf16")`` and
   ``dtype="fp8"`` (e4m3, one float32 scale per token row), everything else equal. Compare the two
   stores: bytes per token on disk, relative RMS error of the fp8 features against the bf16 ones, and
   how often the teacher's argmax (lm_head of the stored final hidden state, what the trainer learns)
   changes under fp8.
3. Train one drafter per store and per seed with identical ``draftsmith.stages.train`` configs (offline mode;
   the seed fixes init and data order, the eval split is by id hash, so a pair differs only in features).
4. Measure each drafter (``--drafter best``, what the pipeline ships, or ``final``) with
   ``SpeculativeDecoder`` (chain k = ``--chain``, greedy) on the held-out prompts (and optionally the first
   ``--mtbench`` MT-bench first turns).

Reported per run: simulated acceptance length (the trainer's held-out split, chain-k truncation of its
per-step accuracies) at the best and at the final step; the same for the measured checkpoint evaluated on the
bf16 store's eval split (the trainer scores an fp8 drafter against the fp8 store's quantised teacher, whose
argmax differs from bf16's at some positions: this puts both in front of the same teacher); and the measured
acceptance length. The fp8 - bf16
difference is paired by seed and set against seed-to-seed noise (the std over seeds within one dtype).
Also: payload bytes per token projected to 4096/7168-wide targets, against SpecForge's offline layout
(int64 ids + int64 mask + bf16 hidden and aux rows, as in bench/bench_data.py). Goal (data issue): at most
half SpecForge's bytes per token at equal trained acceptance.

Not a test: numbers depend on the machine and its load. Writes ``--out`` (default out/bench_fp8.json) and
keeps stores and runs in ``--work`` (redone on every invocation).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

DTYPES = ("bf16", "fp8")
# Question words for the tiny target (its tokenizer spells these as whole words), as in tests/conftest.py.
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "over", "to", "see", "the", "dog", "who",
         "was", "very", "happy", "about", "rain", "sun", "tree", "water", "light", "house", "green", "blue", "small",
         "fast", "slow"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def specforge_payload(width: int, num_aux: int = 3) -> int:
    """SpecForge offline layout, bytes per token: int64 input_ids + int64 loss_mask + bf16 hidden and aux rows."""
    return 8 + 8 + (num_aux + 1) * width * 2


# --- data -----------------------------------------------------------------------------------------------
def tiny_conversations(target, path: Path, n: int, seed: int, new_tokens: int) -> Path:
    """Conversations whose assistant turns are the tiny target's own greedy answers (what EAGLE trains on)."""
    from draftsmith.data.chat import encode_prompt, stop_token_ids
    from draftsmith.stages.decode import SpeculativeDecoder

    rng = random.Random(seed)
    tok = target.tokenizer
    decoder = SpeculativeDecoder(target)
    stops = stop_token_ids(tok)
    with open(path, "w") as f:
        for i in range(n):
            question = " ".join(rng.choices(WORDS, k=rng.randint(3, 8)))
            out = decoder.generate(encode_prompt(tok, question, chat=True), new_tokens, eos_token_ids=stops)
            answer = tok.decode([t for t in out.token_ids if t not in stops], skip_special_tokens=True)
            f.write(json.dumps({"id": f"conv-{i:04d}", "messages": [{"role": "user", "content": question},
                                                                    {"role": "assistant", "content": answer}]}) + "\n")
    return path


def split_conversations(srcs: list[Path], work: Path, held_out: int) -> tuple[Path, list[dict], int]:
    """Snapshot ``srcs`` (first record of an id wins); the ``held_out`` records with the smallest id hash are
    kept out of capture and training. Returns (training JSONL, held-out records, records in the snapshot)."""
    records = []
    seen = set()
    lines = [line for src in srcs for line in src.read_text().splitlines()]  # a snapshot, even mid-append
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # e.g. a half-written last line
        if not isinstance(rec, dict) or "id" not in rec or "messages" not in rec or rec["id"] in seen:
            continue
        seen.add(rec["id"])
        records.append(rec)
    if len(records) <= held_out:
        raise SystemExit(f"{len(records)} usable conversations, need more than --held-out {held_out}")
    # Salted: the trainer's own eval split hashes the bare id, so an unsalted ranking would take exactly its
    # eval samples away and leave it no simulated acceptance to report.
    rank = sorted(records, key=lambda r: hashlib.sha256(f"bench_fp8/held-out/{r['id']}".encode()).hexdigest())
    held_ids = {r["id"] for r in rank[:held_out]}
    train_path = work / "train.jsonl"
    train_path.write_text("".join(json.dumps(r) + "\n" for r in records if r["id"] not in held_ids))
    (work / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["id"] in held_ids))
    return train_path, [r for r in records if r["id"] in held_ids], len(records)


def prompt_of(tokenizer, messages: list[dict]) -> list[int]:
    """Messages up to the first assistant turn, rendered as the generation prompt the target answered."""
    upto = []
    for m in messages:
        if m["role"] == "assistant":
            break
        upto.append({"role": m["role"], "content": m["content"]})
    text = tokenizer.apply_chat_template(upto, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# --- stores ---------------------------------------------------------------------------------------------
def capture_stores(target, train_jsonl: Path, work: Path, args) -> dict:
    from draftsmith.data.store import FeatureStore, estimate_bytes_per_token
    from draftsmith.stages.capture import CaptureConfig, capture

    stores = {}
    for dtype in DTYPES:
        out = work / f"store-{dtype}"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        rep = capture(target, target.tokenizer,
                      CaptureConfig(conversations=train_jsonl, out=out, target=args.target, dtype=dtype,
                                    max_length=args.max_length, batch_size=args.capture_batch,
                                    draft_vocab_size=args.draft_vocab_size, progress=False))
        fs = FeatureStore(out)
        n_aux = fs.num_aux or len(target.aux_layers)
        stores[dtype] = {
            "path": str(out), "samples": len(fs), "tokens": fs.total_tokens, "loss_tokens": fs.total_loss_tokens,
            "bytes": fs.bytes_on_disk, "bytes_per_token": fs.bytes_per_token,
            "payload_bytes_per_token": estimate_bytes_per_token(target.hidden_size, n_aux, dtype),
            "capture_s": time.perf_counter() - t, "counts": rep.to_dict()["counts"],
            "vocab_coverage": rep.vocab.coverage if rep.vocab else None,
        }
        log(f"  {dtype}: {len(fs)} samples, {fs.total_tokens} tokens, {fs.bytes_per_token:.0f} B/token "
            f"({stores[dtype]['capture_s']:.1f} s)")
    return stores


@torch.no_grad()
def compare_stores(target_name: str, stores: dict) -> dict:
    """fp8 vs bf16 features of the same samples: relative RMS error and teacher argmax agreement."""
    from safetensors.torch import load_file

    from draftsmith.data.store import FeatureStore
    from draftsmith.model.target import load_target_heads

    bf, f8 = (FeatureStore(stores[d]["path"], out_dtype=torch.float32) for d in DTYPES)
    lm_head = load_target_heads(target_name, dtype=torch.float32).lm_head_weight.float()
    err = {"aux": [0.0, 0.0], "hidden": [0.0, 0.0]}  # sum of squared error, sum of squares
    agree = total = 0
    for sid in bf.sample_ids:
        a, b = bf.get_by_id(sid), f8.get_by_id(sid)
        for key, name in (("aux_hidden_states", "aux"), ("hidden_state", "hidden")):
            err[name][0] += float((b[key] - a[key]).pow(2).sum())
            err[name][1] += float(a[key].pow(2).sum())
        mask = a["loss_mask"].bool()
        ta = (a["hidden_state"][mask] @ lm_head.T).argmax(-1)
        tb = (b["hidden_state"][mask] @ lm_head.T).argmax(-1)
        agree += int((ta == tb).sum())
        total += int(mask.sum())
    vocab = [load_file(str(Path(stores[d]["path"]) / "vocab.safetensors")) for d in DTYPES]
    same_vocab = all(torch.equal(vocab[0][k], vocab[1][k]) for k in vocab[0])
    return {"aux_relative_rms_error": (err["aux"][0] / max(err["aux"][1], 1e-30)) ** 0.5,
            "hidden_relative_rms_error": (err["hidden"][0] / max(err["hidden"][1], 1e-30)) ** 0.5,
            "teacher_argmax_agreement": agree / max(total, 1), "teacher_positions": total,
            "same_draft_vocab": same_vocab}


# --- train and measure ----------------------------------------------------------------------------------
def train_one(args, store: str, out: Path, seed: int) -> dict:
    from draftsmith.model.ttt import simulated_acceptance_length
    from draftsmith.stages.train import load_config, train

    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, dict(target=args.target, store=store, out=str(out), max_steps=args.max_steps,
                                 ttt_steps=args.ttt_steps, batch_tokens=args.batch_tokens, lr=args.lr,
                                 warmup_steps=max(2, args.max_steps // 20), eval_every=args.eval_every,
                                 save_every=args.max_steps, log_every=10, eval_fraction=args.eval_fraction,
                                 max_length=args.max_length, seed=seed, progress=False, plot=False))
    t = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t
    best = json.loads((out / "best" / "eval.json").read_text()) if (out / "best" / "eval.json").is_file() else {}
    k = args.chain
    final_acc = result.last_eval.get("acc") or []
    return {"steps": result.steps, "train_s": wall, "best_step": best.get("step"), "best_eval_acc": best.get("acc"),
            "final_eval_acc": final_acc, "final_eval_loss": result.last_eval.get("loss"),
            "simulated_tau_best": simulated_acceptance_length(best["acc"][:k]) if best else None,
            "simulated_tau_final": simulated_acceptance_length(final_acc[:k]) if final_acc else None}


@torch.no_grad()
def simulated_on_store(args, drafter_dir: Path, store: str) -> float | None:
    """A trained drafter's simulated acceptance (chain k) on ``store``'s eval split, with that store's teacher.

    The trainer evaluates an fp8-trained drafter against the fp8 store's own (quantised) teacher; this puts
    both drafters in front of the same bf16 features and teacher, so the difference is the drafter's alone."""
    from draftsmith.data.store import FeatureStore
    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target_heads
    from draftsmith.model.ttt import simulated_acceptance_length, teacher_targets
    from draftsmith.stages.train import StoreSource, evaluate, load_config, split_eval

    fs = FeatureStore(store, out_dtype=torch.float32)
    _, eval_idx = split_eval(fs.sample_ids, args.eval_fraction)
    if not eval_idx:
        return None
    heads = load_target_heads(args.target, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, device="cpu", dtype=torch.float32)
    drafter.bind_embeddings(heads.embed_tokens)
    lm_head = heads.lm_head_weight.float()
    target_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size))
    teacher = lambda b: teacher_targets(b, lm_head, target_ids, drafter.t2d, heads.final_logit_softcapping)  # noqa: E731
    cfg = load_config(None, dict(target=args.target, store=store, ttt_steps=args.ttt_steps,
                                 batch_tokens=args.batch_tokens, max_length=args.max_length))
    source = StoreSource(fs, args.max_length, torch.float32)
    ev = evaluate(drafter, source, eval_idx, cfg, teacher, torch.device("cpu"))
    return simulated_acceptance_length(ev["acc"][: args.chain])


def measure(target, drafter, prompts: list[list[int]], k: int, max_new_tokens: int) -> dict:
    from draftsmith.app.bench import decode_prompts
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder

    m, _ = decode_prompts(SpeculativeDecoder(target, drafter, ChainSpec(k)), prompts, max_new_tokens)
    return {"tau": m.acceptance_length, "prompts": len(prompts), "tokens": m.tokens, "verify_passes": m.verify_passes,
            "accepted": m.accepted, "seconds": m.seconds}


# --- summary --------------------------------------------------------------------------------------------
def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    return {"n": len(xs), "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None}


def summarise(runs: list[dict], metrics: list[str]) -> dict:
    out = {}
    for m in metrics:
        per = {d: {r["seed"]: r[m] for r in runs if r["dtype"] == d and r.get(m) is not None} for d in DTYPES}
        seeds = sorted(set(per["bf16"]) & set(per["fp8"]))
        if not seeds:
            continue
        diffs = [per["fp8"][s] - per["bf16"][s] for s in seeds]
        bf, f8 = _stats([per["bf16"][s] for s in seeds]), _stats([per["fp8"][s] for s in seeds])
        noise = [x["std"] for x in (bf, f8) if x["std"] is not None]
        out[m] = {"bf16": bf, "fp8": f8, "paired_diff": _stats(diffs), "diffs": diffs,
                  "relative_diff": f8["mean"] / bf["mean"] - 1 if bf["mean"] else None,
                  # pooled within-dtype std over seeds: what one seed's number wobbles by
                  "seed_noise_std": (statistics.fmean([s * s for s in noise])) ** 0.5 if noise else None}
    return out


def verdict(summary: dict, key: str) -> str:
    """fp8 - bf16 paired by seed: mean, its standard error, sign consistency, and the seed-to-seed std."""
    s = summary.get(key)
    if not s:
        return "no paired runs"
    d = s["paired_diff"]
    text = f"fp8 - bf16 = {d['mean']:+.3f} ({s['relative_diff']:+.1%})"
    if d["std"] is None:
        return text + "; one seed: no noise estimate"
    se = d["std"] / d["n"] ** 0.5
    signs = [r for r in s["diffs"] if r < 0], [r for r in s["diffs"] if r > 0]
    text += (f" +- {se:.3f} (paired SE, {d['n']} seeds; {len(signs[0])} lower, {len(signs[1])} higher); "
             f"seed-to-seed std {s['seed_noise_std']:.3f}")
    paired = "beyond" if abs(d["mean"]) > 2 * se else "within"
    seed = "smaller" if abs(d["mean"]) < s["seed_noise_std"] else "not smaller"
    return text + f": {paired} 2 paired SE, {seed} than one seed's wobble"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny", help="'tiny' (built in --work), 'smollm2', or a model directory")
    ap.add_argument("--conversations", nargs="+", help="conversations JSONL file(s) of the target's own answers "
                                                       "(required unless --target tiny); read only, merged by id")
    ap.add_argument("--work", default="out/bench_fp8_work")
    ap.add_argument("--out", default="out/bench_fp8.json")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds, comma separated")
    ap.add_argument("--tiny-conversations", type=int, default=200, help="self-generated conversations (tiny)")
    ap.add_argument("--answer-tokens", type=int, default=48, help="answer length of self-generated conversations")
    ap.add_argument("--held-out", type=int, default=24, help="conversations kept out for measured acceptance")
    ap.add_argument("--max-steps", type=int, default=None, help="default: 240 tiny, 150 otherwise")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--chain", type=int, default=3, help="chain length k for measured (and simulated) acceptance")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: 1024 tiny, 2048 otherwise")
    ap.add_argument("--lr", type=float, default=None, help="default: 3e-3 tiny, 1e-3 otherwise")
    ap.add_argument("--eval-every", type=int, default=None, help="default: max_steps // 5")
    ap.add_argument("--eval-fraction", type=float, default=0.15, help="trainer's held-out split (simulated tau)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--capture-batch", type=int, default=8)
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="default: 200 tiny, 8192 otherwise")
    ap.add_argument("--new-tokens", type=int, default=None, help="measured decode length (default --answer-tokens "
                                                                 "for tiny, 96 otherwise)")
    ap.add_argument("--mtbench", type=int, default=0, help="also measure on this many MT-bench first turns")
    ap.add_argument("--drafter", choices=("best", "final"), default="best", help="checkpoint to measure")
    args = ap.parse_args()
    from draftsmith.core.allocator import keep_freed_memory

    keep_freed_memory()  # train as `draftsmith train` does

    tiny = args.target == "tiny"
    args.max_steps = args.max_steps or (240 if tiny else 150)
    args.batch_tokens = args.batch_tokens or (1024 if tiny else 2048)
    args.lr = args.lr or (3e-3 if tiny else 1e-3)
    args.eval_every = args.eval_every or max(10, args.max_steps // 5)
    args.draft_vocab_size = args.draft_vocab_size or (200 if tiny else 8192)
    args.new_tokens = args.new_tokens or (args.answer_tokens if tiny else 96)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not tiny and not args.conversations:
        ap.error("--conversations is required with a target other than tiny")
    torch.set_num_threads(args.threads)

    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target

    t0 = time.perf_counter()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if tiny:
        from draftsmith.testing.models import save_tiny_target

        args.target = str(save_tiny_target(work / "target"))
    target = load_target(args.target)
    log(f"== target {args.target}: hidden {target.hidden_size}, aux layers {list(target.aux_layers)} ==")
    if tiny:
        n = args.tiny_conversations + args.held_out
        log(f"== data: {n} self-generated conversations ({args.answer_tokens} answer tokens) ==")
        source = tiny_conversations(target, work / "conversations.jsonl", n, seed=0, new_tokens=args.answer_tokens)
    else:
        source = [Path(c) for c in args.conversations]
    sources = [source] if isinstance(source, Path) else source
    train_jsonl, held, n_records = split_conversations(sources, work, args.held_out)
    log(f"  {n_records} conversations: {n_records - len(held)} captured for training, {len(held)} held out")

    log("== capture: bf16 and fp8 stores of the same conversations ==")
    stores = capture_stores(target, train_jsonl, work, args)
    from draftsmith.data.store import FeatureStore
    from draftsmith.stages.train import split_eval

    trainer_train, trainer_eval = split_eval(FeatureStore(stores["bf16"]["path"]).sample_ids, args.eval_fraction)
    log(f"  trainer split: {len(trainer_train)} train, {len(trainer_eval)} eval (simulated tau) conversations")
    if not trainer_eval:
        log("  warning: the trainer's eval split is empty: no simulated acceptance; raise --eval-fraction")
    features = compare_stores(args.target, stores)
    log(f"  fp8 vs bf16: aux rel. RMS error {features['aux_relative_rms_error']:.4f}, hidden "
        f"{features['hidden_relative_rms_error']:.4f}; teacher argmax agreement "
        f"{features['teacher_argmax_agreement']:.4f} over {features['teacher_positions']} loss positions")

    prompts = {"held_out": [prompt_of(target.tokenizer, r["messages"]) for r in held]}
    if args.mtbench:
        from draftsmith.data.chat import encode_prompt
        from draftsmith.data.prompts import load_prompts

        try:
            mt = load_prompts("mt-bench", args.mtbench, turns=1)
            prompts["mtbench"] = [encode_prompt(target.tokenizer, p.turns[0], chat=True) for p in mt]
        except FileNotFoundError as e:
            log(f"  MT-bench skipped: {e}")

    runs: list[dict] = []
    for seed in seeds:
        for dtype in DTYPES:
            log(f"== train {dtype} seed {seed}: {args.max_steps} steps, ttt_steps={args.ttt_steps} ==")
            out = work / "runs" / f"{dtype}-seed{seed}"
            row = {"dtype": dtype, "seed": seed, **train_one(args, stores[dtype]["path"], out, seed)}
            row["simulated_tau_bf16_teacher"] = simulated_on_store(args, out / args.drafter, stores["bf16"]["path"])
            drafter = load_drafter(out / args.drafter, target)
            for name, ps in prompts.items():
                m = measure(target, drafter, ps, args.chain, args.new_tokens)
                row[f"measured_{name}"] = m
                row[f"measured_tau_{name}"] = m["tau"]
            runs.append(row)
            log(f"  simulated tau best {_f(row['simulated_tau_best'])} (step {row['best_step']}), final "
                f"{_f(row['simulated_tau_final'])}, {args.drafter} on the bf16 teacher "
                f"{_f(row['simulated_tau_bf16_teacher'])}; measured " +
                ", ".join(f"{n} {row[f'measured_tau_{n}']:.3f}" for n in prompts) + f" ({row['train_s']:.0f} s train)")

    metrics = ["simulated_tau_best", "simulated_tau_final", "simulated_tau_bf16_teacher",
               *[f"measured_tau_{n}" for n in prompts]]
    summary = summarise(runs, metrics)
    width = target.hidden_size
    n_aux = len(target.aux_layers)
    projection = {str(h): {"draftsmith-bf16": _payload(h, n_aux, "bf16"), "draftsmith-fp8": _payload(h, n_aux, "fp8"),
                           "specforge": specforge_payload(h, n_aux)} for h in sorted({width, 4096, 7168})}
    result = {
        "target": args.target, "hidden_size": width, "aux_layers": list(target.aux_layers),
        "conversations": [str(p) for p in sources], "records": n_records, "held_out": len(held),
        "settings": {k: getattr(args, k) for k in ("max_steps", "ttt_steps", "chain", "batch_tokens", "lr",
                                                  "eval_every", "eval_fraction", "draft_vocab_size", "new_tokens",
                                                  "drafter", "answer_tokens", "tiny_conversations")} | {"seeds": seeds},
        "trainer_split": {"train": len(trainer_train), "eval": len(trainer_eval)},
        "stores": stores, "fp8_vs_bf16_features": features,
        "bytes_per_token_ratio_fp8_bf16": stores["fp8"]["bytes_per_token"] / stores["bf16"]["bytes_per_token"],
        "payload_bytes_per_token": projection,
        "runs": runs, "summary": summary,
        "verdict": {m: verdict(summary, m) for m in metrics},
        "machine": {"threads": args.threads, "cpu_count": os.cpu_count(),
                    "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
                    "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "total_s": time.perf_counter() - t0,
    }
    print_report(result, metrics)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ntotal {result['total_s'] / 60:.1f} min; wrote {out}")
    return 0


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _payload(width: int, n_aux: int, dtype: str) -> int:
    from draftsmith.data.store import estimate_bytes_per_token

    return estimate_bytes_per_token(width, n_aux, dtype)


def print_report(r: dict, metrics: list[str]) -> None:
    s = r["settings"]
    print(f"\nfp8 vs bf16 feature store: target {r['target']} (hidden {r['hidden_size']}), "
          f"{r['stores']['bf16']['samples']} captured conversations ({r['trainer_split']['eval']} of them the "
          f"trainer's eval split), {r['held_out']} held out; "
          f"{s['max_steps']} steps, ttt_steps={s['ttt_steps']}, chain k={s['chain']} greedy, seeds {s['seeds']}")
    print(f"\n{'store':<6}{'B/token':>9}{'payload':>9}{'rel':>6}")
    for d in DTYPES:
        st = r["stores"][d]
        print(f"{d:<6}{st['bytes_per_token']:>9.0f}{st['payload_bytes_per_token']:>9}"
              f"{st['bytes_per_token'] / r['stores']['bf16']['bytes_per_token']:>6.2f}")
    f = r["fp8_vs_bf16_features"]
    print(f"fp8 error vs bf16: aux rel. RMS {f['aux_relative_rms_error']:.4f}, "
          f"hidden {f['hidden_relative_rms_error']:.4f}; "
          f"teacher argmax unchanged at {f['teacher_argmax_agreement']:.2%} of loss positions")
    print("payload B/token at other widths (SpecForge = int64 ids + int64 mask + bf16 rows):")
    for h, p in r["payload_bytes_per_token"].items():
        print(f"  H={h:>5}: bf16 {p['draftsmith-bf16']:>6}, fp8 {p['draftsmith-fp8']:>6}, SpecForge "
              f"{p['specforge']:>6} -> fp8/SpecForge {p['draftsmith-fp8'] / p['specforge']:.3f}")

    names = {"simulated_tau_best": "sim best", "simulated_tau_final": "sim final",
             "simulated_tau_bf16_teacher": "sim bf16 tchr"}
    cols = [(m, names.get(m, m.replace("measured_tau_", "meas "))) for m in metrics]
    print(f"\n{'dtype':<6}{'seed':>5}" + "".join(f"{c:>14}" for _, c in cols) + f"{'train s':>9}")
    for run in r["runs"]:
        vals = "".join(f"{run[m]:>14.3f}" if run.get(m) is not None else f"{'-':>14}" for m, _ in cols)
        print(f"{run['dtype']:<6}{run['seed']:>5}{vals}{run['train_s']:>9.0f}")
    print(f"\n{'metric':<14}{'bf16 mean':>10}{'fp8 mean':>10}{'fp8-bf16':>10}{'rel':>8}{'diff sd':>9}{'seed sd':>9}")
    for m, c in cols:
        x = r["summary"].get(m)
        if not x:
            continue
        fmt = lambda v, spec: f"{v:{spec}}" if v is not None else "-"  # noqa: E731
        print(f"{c:<14}{fmt(x['bf16']['mean'], '>10.3f'):>10}{fmt(x['fp8']['mean'], '>10.3f'):>10}"
              f"{fmt(x['paired_diff']['mean'], '>+10.3f'):>10}{fmt(x['relative_diff'], '>+8.1%'):>8}"
              f"{fmt(x['paired_diff']['std'], '>9.3f'):>9}{fmt(x['seed_noise_std'], '>9.3f'):>9}")
    print(f"fp8 stores {r['bytes_per_token_ratio_fp8_bf16']:.2f}x the bytes/token of bf16")
    for m, v in r["verdict"].items():
        print(f"  {names.get(m, m.replace('measured_tau_', 'meas '))}: {v}")


if __name__ == "__main__":
    sys.exit(main())
