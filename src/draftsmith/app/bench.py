"""Measure a drafter on real prompt sets: plain vs speculative decoding, side by side in one process.

Every prompt is decoded by every method in turn (plain, EAGLE-3, prompt lookup), so machine noise hits
them alike, and speedups are reported as ratios of tokens/s measured in the same run. Prompt sets come from
`draftsmith.data.prompts`.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.core.errors import UsageError
from draftsmith.data.chat import stop_token_ids
from draftsmith.data.prompts import BenchPrompt, load_prompts, training_overlap
from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import (
    ChainSpec,
    DecodeResult,
    HybridSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
)


@dataclass
class MethodStats:
    """Totals for one method over a prompt set; ratios are computed from totals, not averaged."""

    tokens: int = 0
    seconds: float = 0.0
    verify_passes: int = 0
    accepted: int = 0
    lookup_accepted: int = 0  # hybrid: accepted tokens only prompt lookup proposed
    draft_time: float = 0.0
    verify_time: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    requests: int = 0
    prefill_time: float = 0.0
    decode_steps: int = 0  # target passes after prefill (plain: one per token; speculative: verify passes)
    identical: int = 0  # requests whose tokens equal plain decoding's (greedy only; see run_bench)
    compared: int = 0
    ties: int = 0  # of the others: first difference where the target's top-2 logits are a rounding tie

    def add(self, r: DecodeResult, max_accepted: int) -> None:
        self.tokens += len(r.token_ids)
        self.seconds += r.total_time
        self.prefill_time += r.prefill_time
        self.decode_steps += max(0, r.target_forward_passes - 1)
        self.verify_passes += len(r.accepted_per_step)
        self.accepted += sum(r.accepted_per_step)
        self.lookup_accepted += sum(r.lookup_accepted_per_step)
        self.draft_time += r.draft_time
        self.verify_time += r.verify_time
        per = r.accepted_per_position(max_accepted)
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * max_accepted
        self.accepted_per_position = [a + b for a, b in zip(self.accepted_per_position, per, strict=True)]
        self.requests += 1

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.verify_passes if self.verify_passes else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def overhead_time(self) -> float:
        """Wall time outside prefill, drafting and target passes: Python, sampling, bookkeeping."""
        return max(0.0, self.seconds - self.prefill_time - self.draft_time - self.verify_time)

    def to_dict(self) -> dict:
        passes = max(1, self.verify_passes)
        d = {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
             "acceptance_length": self.acceptance_length, "verify_passes": self.verify_passes,
             "accepted": self.accepted, "prefill_time": self.prefill_time, "draft_time": self.draft_time,
             "verify_time": self.verify_time, "overhead_time": self.overhead_time,
             "step_time": self.verify_time / max(1, self.decode_steps),
             "acceptance_per_position": [a / passes for a in self.accepted_per_position],
             "requests": self.requests}
        if self.lookup_accepted:
            d["lookup_accepted"] = self.lookup_accepted  # the drafter's share: accepted - lookup_accepted
        if self.compared:
            d["identical_to_plain"] = f"{self.identical}/{self.compared}"
            d["diverged_at_tie"] = self.ties
        return d


def speedup_bound(method: dict, plain: dict) -> float | None:
    """tau * t_plain_step / (t_verify + t_draft) per round: what this method could reach with no other costs."""
    if not method["verify_passes"] or not plain["step_time"]:
        return None
    per_round = (method["verify_time"] + method["draft_time"]) / method["verify_passes"]
    return method["acceptance_length"] * plain["step_time"] / per_round if per_round else None


def decode_prompts(decoder: SpeculativeDecoder, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int) -> tuple[MethodStats, list[DecodeResult]]:
    """Greedy-decode token-id prompts (stopping at the target's stop tokens): totals and per-request results."""
    stops = stop_token_ids(decoder.target.tokenizer)
    spec = decoder.spec
    stats, results = MethodStats(), []
    for p in prompts:
        r = decoder.generate(p, max_new_tokens, eos_token_ids=stops)
        stats.add(r, spec.max_accepted if spec is not None else 0)
        results.append(r)
    return stats, results


def spec_name(spec) -> str:
    if spec is None:
        return "plain"
    if isinstance(spec, ChainSpec):
        return f"eagle3 chain k={spec.k}"
    if isinstance(spec, TreeSpec):
        return f"eagle3 tree {spec.depth},{spec.top_k},{spec.total_tokens}"
    if isinstance(spec, BlockSpec):
        return f"{spec.kind} block k={spec.k}"
    if isinstance(spec, HybridSpec):
        return (f"hybrid {spec.tree.depth},{spec.tree.top_k},{spec.tree.total_tokens}+lookup {spec.lookup.k}"
                f"{spec.lookup.ngram_label}")
    return f"prompt lookup k={spec.k}{spec.ngram_label}"


def check_bench_args(datasets: Sequence[str], temperatures: Sequence[float], limit: int | None = None,
                     turns: int | None = None, max_new_tokens: int = 128,
                     prompt_lookup_ks: Sequence[int] = (3,)) -> dict[str, list[BenchPrompt]]:
    """Validate a bench run before anything is decoded; returns each dataset's prompts (none may be empty)."""
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for name, value in (("limit", limit), ("turns", turns)):
        if value is not None and value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    for k in prompt_lookup_ks:
        NgramSpec(k)  # raises for a bad K
    if not datasets:
        raise UsageError("no dataset to bench on")
    if not temperatures:
        raise UsageError("no temperature to bench at")
    for t in temperatures:
        SamplingParams(temperature=t)  # raises for a bad one
    prompt_sets = {}
    for dataset in datasets:
        prompts = load_prompts(dataset, limit, turns)
        if not prompts or not any(p.turns for p in prompts):
            raise UsageError(f"{dataset}: no usable prompt (no line with a user turn)")
        prompt_sets[dataset] = prompts
    return prompt_sets


def warn_leaks(prompt_sets: dict[str, list[BenchPrompt]], conversations: Sequence[str | Path]) -> list[str]:
    """Warn about measured prompts the drafter was trained on: its acceptance there says nothing."""
    leaked = sorted({pid for path in conversations for prompts in prompt_sets.values()
                     for pid in training_overlap(prompts, path)})
    if leaked:
        shown = ", ".join(leaked[:5]) + (f" and {len(leaked) - 5} more" if len(leaked) > 5 else "")
        print(f"draftsmith: warning: {len(leaked)} measured prompt(s) appear in the training conversations "
              f"({shown}): their acceptance is not a held-out measurement", file=sys.stderr)
    return leaked


def run_bench(target, drafter, datasets: Sequence[str], specs: Sequence, temperatures: Sequence[float] = (0.0,),
              limit: int | None = None, turns: int | None = None, max_new_tokens: int = 128,
              prompt_lookup_ks: Sequence[int] = (3,), seed: int = 0, progress: bool = True,
              train_conversations: Sequence[str | Path] = (), expected: Sequence = ()) -> dict:
    """The whole measurement; returns a JSON-able report (see ``format_table``).

    ``expected``: (Acceptance, VerifyCost) pairs from calibration (``shapes.expectation_basis``); every method
    measured at an acceptance's temperature gets what it expected beside what it measured, so the gap shows.

    Raises UsageError before decoding anything for bad arguments or a prompt set with no usable prompt.
    """
    prompt_sets = check_bench_args(datasets, temperatures, limit, turns, max_new_tokens, prompt_lookup_ks)
    leaked = warn_leaks(prompt_sets, train_conversations)
    tok = target.tokenizer
    stops = stop_token_ids(tok)
    methods = [("plain", None)] + [(spec_name(s), s) for s in specs]
    methods += [(spec_name(NgramSpec(k)), NgramSpec(k)) for k in dict.fromkeys(prompt_lookup_ks)]
    decoders = {name: SpeculativeDecoder(target, None if s is None or isinstance(s, NgramSpec) else drafter, s)
                for name, s in methods}
    # Warm-up so first-call costs do not land on one method.
    warm = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    for d in decoders.values():
        d.generate(tok(warm, add_special_tokens=False)["input_ids"], 4, eos_token_ids=stops)
    report = {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."), "packed": target.packed,
              "device": str(target.device), "machine": machine_info(),
              "max_new_tokens": max_new_tokens, "results": [], **({"leaked_prompts": leaked} if leaked else {}),
              **({"expected_from": [acc.source for acc, _ in expected]} if expected else {})}
    for dataset in datasets:
        prompts = prompt_sets[dataset]
        for temperature in temperatures:
            sampling = SamplingParams(temperature=temperature)
            stats = {name: MethodStats() for name, _ in methods}
            bar = _bar(progress, len(prompts), f"{dataset} T={temperature}")
            for i, prompt in enumerate(prompts):
                histories = {name: [] for name, _ in methods}
                for turn, user in enumerate(prompt.turns):
                    plain_ids = None
                    for name, spec in methods:
                        msgs = histories[name] + [{"role": "user", "content": user}]
                        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                        ids = tok(text, add_special_tokens=False)["input_ids"]
                        gen = torch.Generator(device=target.device).manual_seed(seed + i)
                        r = decoders[name].generate(ids, max_new_tokens, sampling, eos_token_ids=stops, generator=gen)
                        stats[name].add(r, spec.max_accepted if spec is not None else 0)
                        if spec is None:
                            plain_ids = r.token_ids
                        elif sampling.greedy and turn == 0:
                            # Greedy output must equal plain decoding's; in fp32 it does token for token. In bf16
                            # a k-token verify pass rounds differently from 1-token steps, so near-ties can flip.
                            stats[name].compared += 1
                            if r.token_ids == plain_ids:
                                stats[name].identical += 1
                            else:
                                stats[name].ties += diverged_at_tie(target, ids, plain_ids, r.token_ids)
                        answer = tok.decode(r.token_ids, skip_special_tokens=True)
                        histories[name] = msgs + [{"role": "assistant", "content": answer}]
                if bar is not None:
                    bar.update(1)
                    plain_tps = stats["plain"].tokens_per_second
                    bar.set_postfix({n.split(" ")[0] + ("" if " " not in n else n.split(" ")[1][:4]):
                                     f"{s.tokens_per_second / plain_tps:.2f}x" for n, s in stats.items()
                                     if n != "plain" and plain_tps})
            if bar is not None:
                bar.close()
            plain = stats["plain"].tokens_per_second
            rows = {name: {**s.to_dict(), "speedup": s.tokens_per_second / plain if plain else 0.0}
                    for name, s in stats.items()}
            for row in rows.values():
                row["speedup_bound"] = speedup_bound(row, rows["plain"])
            add_expected(rows, dict(methods), temperature, expected)
            report["results"].append({"dataset": dataset, "temperature": temperature, "prompts": len(prompts),
                                      "methods": rows})
    return report


def add_expected(rows: dict[str, dict], specs: dict, temperature: float, expected: Sequence) -> None:
    """Each row's expectation (``shapes.expectation``: tau and speedup, the conservative low end, the point and
    the interval over calibration prompts) from the calibration made at this temperature, where there is one."""
    from draftsmith.stages.expectation import expectation

    for acc, cost in expected:
        if abs(acc.temperature - temperature) > 1e-9:
            continue
        for name, row in rows.items():
            row["expected"] = expectation(acc, specs[name], cost).to_dict()
        return


def diverged_at_tie(target, prompt_ids: list[int], plain_ids: list[int], other_ids: list[int]) -> bool:
    """Whether two greedy outputs part where the target's two candidates are within rounding of each other.

    One full forward over the common prefix; a tie means the logits of both tokens differ by at most two
    units in the last place of the target's dtype, so either is a correct greedy choice at that precision.
    """
    j = next((i for i, (a, b) in enumerate(zip(plain_ids, other_ids, strict=False)) if a != b), None)
    if j is None:  # one is a prefix of the other: a stop token was emitted in one only, not a tie
        return False
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + plain_ids[:j]], device=target.device)
        logits = target(ids, cache=target.new_cache(), logits_to_keep=1).logits[0, -1].float()
    a, b = float(logits[plain_ids[j]]), float(logits[other_ids[j]])
    top = max(abs(a), abs(b), 1e-6)
    ulp = 2.0 ** math.floor(math.log2(top)) * torch.finfo(target.dtype).eps
    return abs(a - b) <= 2 * ulp


def machine_info() -> dict:
    import os

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from draftsmith.core.machine import machine_key

    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "flags": machine_key("cpu")["flags"]}


def machine_line(info: dict) -> str:
    """'Intel Xeon, 2 cores (AMX, avx512_bf16), 2 torch threads, torch 2.13.0': AMX or not decides the numbers."""
    flags = info.get("flags")
    kind = "" if flags is None else (" (AMX" if "amx_bf16" in flags else " (no AMX") + (
        ", avx512_bf16)" if "avx512_bf16" in flags else ", no avx512_bf16)")
    return (f"{info['cpu']}, {info['cores']} cores{kind}, {info['torch_threads']} torch threads, "
            f"torch {info['torch']}")


def _target_line(report: dict, quote: str = "") -> str:
    packed = {True: ", prepacked linears", False: ", plain linears"}.get(report.get("packed"), "")
    return f"{quote}{report['target']}{quote} ({report.get('dtype', '?')}{packed})"


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, dynamic_ncols=True)


def format_table(report: dict) -> str:
    """One row per method; 'bound' is tau * t_step / (t_verify + t_draft) and the time split says where it goes."""
    lines = [f"{'dataset':<12}{'T':>4}  {'method':<24}{'tau':>6}{'expected':>18}{'tok/s':>7}{'speedup':>8}"
             f"{'expected':>19}{'bound':>7}  {'draft/verify/prefill/other':<27}{'same (tie)':>10}  "
             "acceptance per position"]
    for res in report["results"]:
        for name, m in res["methods"].items():
            per = " ".join(f"{a:.2f}" for a in m["acceptance_per_position"])
            bound = f"{m['speedup_bound']:.2f}x" if m.get("speedup_bound") else "-"
            total = max(m["seconds"], 1e-9)
            split = "/".join(f"{100 * m.get(k, 0.0) / total:.0f}" for k in
                             ("draft_time", "verify_time", "prefill_time", "overhead_time")) + " %"
            lines.append(f"{res['dataset']:<12}{res['temperature']:>4.1f}  {name:<24}{m['acceptance_length']:>6.2f}"
                         f"{_expected(m, 'tau'):>18}{m['tokens_per_second']:>7.1f}{m['speedup']:>7.2f}x"
                         f"{_expected(m, 'speedup', 'x'):>19}{bound:>7}  {split:<27}{_same(m):>10}  {per}")
    info = report["machine"]
    lines.append(f"target {_target_line(report)}; machine: {machine_line(info)}; "
                 f"max_new_tokens={report['max_new_tokens']}")
    if report.get("expected_from"):
        lines.append("expected: the conservative low end (point, interval over calibration prompts), from "
                     + "; ".join(report["expected_from"]))
    lines.append("same: greedy first-turn outputs equal to plain decoding's; (tie): of the others, how many first "
                 "differ where the target's two candidate logits are within 2 ulp (a rounding tie in its dtype)")
    return "\n".join(lines)


def _expected(m: dict, key: str, unit: str = "") -> str:
    """'2.10 (2.4, 1.9-2.9)': the expectation's low end, its point and interval; '-' where none was made."""
    e = (m.get("expected") or {}).get(key)
    if not e:
        return "-"
    if e["low"] == e["high"]:
        return f"{e['point']:.2f}{unit}"
    return f"{e['low']:.2f}{unit} ({e['point']:.2f}, {e['low']:.2f}-{e['high']:.2f})"


def _same(m: dict) -> str:
    if "identical_to_plain" not in m:
        return "-"
    return f"{m['identical_to_plain']} ({m['diverged_at_tie']})"


def plot_report(report: dict, path: Path) -> Path | None:
    """Per-position acceptance (per dataset) and speedup per dataset and method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels, speedups = [], {}
    for res in report["results"]:
        label = f"{res['dataset']} T={res['temperature']:g}"
        labels.append(label)
        for name, m in res["methods"].items():
            if name == "plain":
                continue
            speedups.setdefault(name, []).append(m["speedup"])
            if m["acceptance_per_position"]:
                axes[0].plot(range(1, len(m["acceptance_per_position"]) + 1), m["acceptance_per_position"],
                             marker="o", label=f"{label}: {name}")
    from matplotlib.ticker import MaxNLocator

    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_xlabel("draft position")
    axes[0].set_ylabel("share of verify passes accepting it")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    width = 0.8 / max(1, len(speedups))
    for j, (name, vals) in enumerate(speedups.items()):
        axes[1].bar([i + j * width for i in range(len(vals))], vals, width=width, label=name)
    axes[1].axhline(1.0, color="gray", linestyle="--")
    axes[1].set_xticks([i + width * (len(speedups) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    axes[1].set_ylabel("speedup over plain decoding")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(report: dict, out: Path) -> dict[str, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "table": out / "bench.txt"}
    paths["json"].write_text(json.dumps(report, indent=2))
    paths["table"].write_text(format_table(report) + "\n")
    png = plot_report(report, out / "bench.png")
    if png:
        paths["png"] = png
    return paths





def markdown_table(report: dict, command: str | None = None) -> str:
    """The report as a Markdown table, with the machine and the command that produced it."""
    info = report["machine"]
    # Expected columns only where the report has expectations (an older report's table stays as it was rendered).
    has = any("expected" in m for res in report["results"] for m in res["methods"].values())
    exp = (lambda m, key, unit="": f" {_expected(m, key, unit)} |") if has else (lambda m, key, unit="": "")  # noqa: E731
    rows = ["| dataset | T | method | acceptance length |" + (" expected |" if has else "") + " tok/s | speedup |"
            + (" expected |" if has else "") + " bound | same as plain (tie) |",
            "|---|---|---|---|---|---|---|---|" + ("---|---|" if has else "")]
    for res in report["results"]:
        for name, m in res["methods"].items():
            bound = f"{m['speedup_bound']:.2f}x" if m.get("speedup_bound") else "-"
            rows.append(f"| {res['dataset']} ({res['prompts']} prompts) | {res['temperature']:g} | {name} | "
                        f"{m['acceptance_length']:.2f} |{exp(m, 'tau')} {m['tokens_per_second']:.1f} | "
                        f"{m['speedup']:.2f}x |{exp(m, 'speedup', 'x')} {bound} | {_same(m)} |")
    rows.append("")
    rows.append(f"Target {_target_line(report, '`')}, max {report['max_new_tokens']} new tokens; "
                f"machine: {machine_line(info)}. Bound: tau x plain step time / (verify + draft time per round). "
                f"Same as plain: greedy outputs identical to plain decoding's; (tie): of the others, those whose "
                f"first difference is a rounding tie of the target's top two logits "
                f"(within 2 ulp in {report.get('dtype', '?')}).")
    if report.get("expected_from"):
        rows.append("Expected: the conservative low end (point, interval over calibration prompts), from "
                    + "; ".join(report["expected_from"]) + ".")
    if command:
        rows.append(f"Produced by `{command}`.")
    return "\n".join(rows)


def readme_markers(section: str = "bench") -> tuple[str, str]:
    """The comments that bound a README section that bench fills (one section per machine kind, say)."""
    return f"<!-- {section}:start -->", f"<!-- {section}:end -->"


def check_readme(readme: Path, section: str = "bench") -> None:
    """Before a bench of minutes: the README must have the section its table will fill."""
    start, end = readme_markers(section)
    try:
        text = Path(readme).read_text()
    except OSError as e:
        raise UsageError(f"--readme {readme}: {e.strerror or e}") from e
    if start not in text or end not in text:
        raise UsageError(f"{readme} has no {start} ... {end} section to fill")


def update_readme(readme: Path, report: dict, command: str | None = None, section: str = "bench") -> None:
    """Replace the text between the section's markers of a README with the report's table."""
    check_readme(readme, section)
    start, end = readme_markers(section)
    readme = Path(readme)
    head, rest = readme.read_text().split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{markdown_table(report, command)}\n{end}{tail}")
