"""``bench --engine llamacpp``: the drafter measured in llama.cpp (xllamacpp), against llama.cpp plain and its n-gram.

Same prompt sets and chat template as ``bench``: each prompt is rendered with the target's chat template and sent
as token ids, and every method decodes it in turn (plain, EAGLE-3 at each k, n-gram lookup at each k), so machine
noise hits them alike. Greedy only. Speed is the engine's decode rate (``predicted_n / predicted_ms``: prefill
excluded, which every method pays alike); tau comes from the engine's counters (``draft_n_accepted`` over verify
passes). Where EAGLE-3 does not pay, the profile splits its round: a verify pass of up to k+1 tokens (measured on the
n-gram rounds, whose drafting costs ~nothing) and the drafter's share (the rest of an EAGLE-3 round).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.core.errors import UsageError
from draftsmith.integrations.llamacpp import EngineRun, LlamaCppEngine


@dataclass
class EngineStats:
    tokens: int = 0
    ms: float = 0.0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    compared: int = 0
    identical: int = 0
    rates: list[float] = field(default_factory=list)  # tok/s per request: the spread is the noise

    def add(self, r: EngineRun) -> None:
        self.tokens += r.completion_tokens
        self.ms += r.predicted_ms
        self.passes += r.verify_passes
        self.drafted += r.draft_n
        self.accepted += r.accepted_emitted  # not the drafts llama.cpp counts past a stop token
        self.rates.append(r.tokens_per_second)

    def to_dict(self) -> dict:
        tps = 1000.0 * self.tokens / self.ms if self.ms else 0.0
        return {"tokens": self.tokens, "decode_ms": round(self.ms, 1), "tokens_per_second": round(tps, 2),
                "acceptance_length": round(1 + self.accepted / self.passes, 3) if self.passes else 1.0,
                "ms_per_pass": round(self.ms / self.passes, 2) if self.passes else 0.0,
                "drafted": self.drafted, "accepted": self.accepted,
                "request_tok_s_min": round(min(self.rates), 2) if self.rates else 0.0,
                "request_tok_s_median": round(statistics.median(self.rates), 2) if self.rates else 0.0,
                "same_as_plain": f"{self.identical}/{self.compared}" if self.compared else "-"}


def engine_methods(ks: Sequence[int], ngram_ks: Sequence[int], mode: str = "eagle3") -> list[tuple[str, str, int]]:
    """``mode``: the drafter's (eagle3, dflash, dspark); a block drafter's k is its drafts per block."""
    return ([("plain", "plain", 0)] + [(f"{mode} k={k}", mode, k) for k in ks]
            + [(f"ngram k={k}", "ngram", k) for k in ngram_ks])


def run_llamacpp_bench(target_gguf: str | Path, drafter_gguf: str | Path, tokenizer, prompt_sets: dict,
                       ks: Sequence[int], ngram_ks: Sequence[int] = (3,), max_new_tokens: int = 128,
                       threads: int = 1, progress: bool = True, verbose: bool = False) -> dict:
    """Decode every prompt with every method (interleaved); return a JSON-able report. ``verbose``: llama.cpp's
    own log on stderr (model loading, every request: dozens of lines a run)."""
    from draftsmith.integrations.llamacpp import DRAFT_TYPES, drafter_mode

    if not ks:
        raise UsageError("bench --engine llamacpp needs at least one --chain k")
    kind = drafter_mode(drafter_gguf)
    methods = engine_methods(ks, ngram_ks, kind)
    try:
        engines = {name: LlamaCppEngine(target_gguf, mode, drafter=drafter_gguf if mode in DRAFT_TYPES else None,
                                        k=max(k, 1), threads=threads, verbose=verbose) for name, mode, k in methods}
    except RuntimeError as e:  # what the checks before did not foresee: llama.cpp's own refusal, on one line
        raise UsageError(f"llama.cpp could not load {target_gguf} with {drafter_gguf} ({e}); run with --verbose to "
                         "see its log") from e
    for e in engines.values():  # warm-up: first-call costs land on no method
        e.complete(tokenizer("Hi")["input_ids"], 4)
    report = {"engine": "llamacpp", "target": str(target_gguf), "drafter": str(drafter_gguf), "kind": kind,
              "threads": threads, "max_new_tokens": max_new_tokens, "results": []}
    for dataset, prompts in prompt_sets.items():
        stats = {name: EngineStats() for name, _, _ in methods}
        for i, prompt in enumerate(prompts):
            histories = {name: [] for name, _, _ in methods}
            for turn, user in enumerate(prompt.turns):
                plain_text = None
                for name, _, _ in methods:
                    msgs = histories[name] + [{"role": "user", "content": user}]
                    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                    r = engines[name].complete(ids, max_new_tokens)
                    stats[name].add(r)
                    if name == "plain":
                        plain_text = r.text
                    elif turn == 0:
                        stats[name].compared += 1
                        stats[name].identical += r.text == plain_text
                    histories[name] = msgs + [{"role": "assistant", "content": r.text}]
            if progress:
                print(f"llamacpp bench {dataset}: {i + 1}/{len(prompts)}", end="\r", file=sys.stderr, flush=True)
        rows = {name: s.to_dict() for name, s in stats.items()}
        plain = rows["plain"]["tokens_per_second"]
        for row in rows.values():
            row["speedup"] = round(row["tokens_per_second"] / plain, 3) if plain else 0.0
        report["results"].append({"dataset": dataset, "prompts": len(prompts), "methods": rows,
                                  "profile": round_profile(rows, ks, kind)})
    return report


def round_profile(rows: dict, ks: Sequence[int], mode: str = "eagle3") -> dict:
    """Where a drafter round's time goes, per k: target step (plain), verify pass, drafter (estimate). The round's
    time is under ``eagle3_ms_per_round`` whatever the drafter's kind (the key readers of older reports know)."""
    plain_ms = rows["plain"]["ms_per_pass"]
    out = {"plain_ms_per_token": plain_ms}
    for k in ks:
        e, g = rows.get(f"{mode} k={k}"), rows.get(f"ngram k={k}")
        if e is None:
            continue
        verify = g["ms_per_pass"] if g else None
        out[f"k={k}"] = {"eagle3_ms_per_round": e["ms_per_pass"], "verify_ms_per_pass": verify,
                         "drafter_ms_per_round": round(e["ms_per_pass"] - verify, 2) if verify else None,
                         "break_even_tau": round(e["ms_per_pass"] / plain_ms, 2) if plain_ms else None,
                         "tau": e["acceptance_length"]}
    return out


_DISPLAY = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}


def format_llamacpp_table(report: dict) -> str:
    lines = [f"llama.cpp (xllamacpp) on {report['target']}, {report['threads']} thread(s), greedy, "
             f"{report['max_new_tokens']} new tokens"]
    for res in report["results"]:
        lines.append(f"{res['dataset']} ({res['prompts']} prompts)")
        lines.append(f"  {'method':<12} {'tok/s':>7} {'min':>6} {'median':>7} {'speedup':>7} {'tau':>5} "
                     f"{'ms/pass':>7} {'same':>6}")
        for name, m in res["methods"].items():
            lines.append(f"  {name:<12} {m['tokens_per_second']:7.1f} {m['request_tok_s_min']:6.1f} "
                         f"{m['request_tok_s_median']:7.1f} {m['speedup']:6.2f}x {m['acceptance_length']:5.2f} "
                         f"{m['ms_per_pass']:7.1f} {m['same_as_plain']:>6}")
        p, who = res["profile"], _DISPLAY[report.get("kind", "eagle3")]
        for key, v in p.items():
            if key.startswith("k="):  # the split needs the n-gram row at the same k (its verify passes)
                split = "" if v["verify_ms_per_pass"] is None else (
                    f" = verify {v['verify_ms_per_pass']} ms + drafter ~{v['drafter_ms_per_round']} ms")
                lines.append(f"  profile {key}: round {v['eagle3_ms_per_round']} ms{split}; one plain "
                             f"step {p['plain_ms_per_token']} ms, so {who} pays above tau "
                             f"{v['break_even_tau']} (measured {v['tau']})")
    return "\n".join(lines)


def llamacpp_target(target: str | Path) -> Path:
    """The target's .gguf that llama.cpp loads: the embedded default's, or a .gguf file; else a one-line refusal."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT, smollm2_gguf_path

    if str(target) == EMBEDDED_DEFAULT:
        try:
            return smollm2_gguf_path()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    path = Path(target).expanduser()
    if not (path.is_file() and path.suffix == ".gguf"):
        raise UsageError(f"{target}: bench --engine llamacpp needs the target's .gguf (or smollm2)")
    return path


# bench's flags that only the draftsmith engine uses, with their defaults: given with --engine llamacpp, refused
# rather than silently dropped.
UNUSED_FLAGS = (("tree", "--tree", None), ("shape", "--shape", None), ("hybrid", "--hybrid", None),
                ("hybrid_min_ngram", "--hybrid-min-ngram", None), ("readme", "--readme", None),
                ("readme_section", "--readme-section", "bench"), ("dtype", "--dtype", None),
                ("device", "--device", "auto"), ("aux_layers", "--aux-layers", None))


def check_llamacpp_args(args) -> tuple[list[int], list[int]]:
    """The EAGLE-3 and n-gram draft lengths to measure, after refusing what this engine cannot honour."""
    from draftsmith.app.args import parse_ints
    from draftsmith.stages.export.gguf import check_draft_max

    given = [flag for dest, flag, default in UNUSED_FLAGS if getattr(args, dest, default) not in (
        default, *(("cpu",) if dest == "device" else ()))]
    if given:
        raise UsageError(f"bench --engine llamacpp does not use {', '.join(given)} (the draftsmith engine's); drop "
                         f"{'them' if len(given) > 1 else 'it'}")
    if args.draft_max is not None and args.chain is not None:
        raise UsageError("bench --engine llamacpp: give --draft-max (its chain lengths) or --chain, not both")
    ks = parse_ints(args.draft_max) or [args.chain or 3]
    for k in ks:
        check_draft_max(k, "--draft-max")
    ngram_ks = [k for k in (parse_ints(args.prompt_lookup) or []) if k]
    if args.threads < 1:
        raise UsageError(f"--threads takes a number >= 1, got {args.threads}")
    if args.temperature not in ("0", "0.0"):
        raise UsageError("bench --engine llamacpp measures greedy decoding only (--temperature 0)")
    out = Path(args.out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UsageError(f"--out {args.out}: {blocker} exists and is not a directory (bench-llamacpp.json and "
                         "bench-llamacpp.txt go in the --out directory)")
    return ks, ngram_ks


def check_llamacpp_pair(target: str | Path, drafter: str | Path) -> None:
    """doctor --engine llamacpp's checks, before llama.cpp sees the files: what it would refuse at load, or abort
    the whole process on at the first decode (a drafter for another target), ends in one line here instead."""
    from draftsmith.stages.doctor.llamacpp_checks import diagnose_llamacpp

    report = diagnose_llamacpp(target, drafter)
    errors = [f for f in report.findings if f.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UsageError(f"llama.cpp cannot run this pair: {errors[0].id}: {errors[0].message}{more}; "
                         f"doctor --engine llamacpp --target {target} --drafter {drafter} says more")


def bench_llamacpp_command(args) -> int:
    """The CLI's ``bench --engine llamacpp``: check the flags and the GGUFs, measure, write bench-llamacpp.json."""
    import json

    from draftsmith.app.bench import check_bench_args, warn_leaks
    from draftsmith.core.io import atomic_write, process_temp_dir
    from draftsmith.integrations.llamacpp import available
    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    if not available():
        raise UsageError("bench --engine llamacpp needs xllamacpp: pip install 'draftsmith[llamacpp]'")
    ks, ngram_ks = check_llamacpp_args(args)
    target_gguf = llamacpp_target(args.target)
    prompt_sets = check_bench_args([d for d in args.datasets.split(",") if d], [0.0], limit=args.limit,
                                   turns=args.turns, max_new_tokens=args.max_new_tokens, prompt_lookup_ks=ngram_ks)
    check_llamacpp_pair(args.target, args.drafter)
    if str(args.target) == EMBEDDED_DEFAULT:
        tok_dir, tok_kw = ensure_smollm2(), {}
    else:
        tok_dir, tok_kw = target_gguf.parent, {"gguf_file": target_gguf.name}
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, **tok_kw)
    except Exception as e:  # noqa: BLE001 - transformers' GGUF tokenizer parser on a file it cannot take
        raise UsageError(f"{target_gguf}: transformers cannot read its tokenizer, which bench renders the prompts "
                         f"with ({type(e).__name__}: {e})") from e
    leaked = warn_leaks(prompt_sets, args.train_conversations)
    with process_temp_dir("draftsmith-gguf-") as tmp:  # a killed bench's directory goes at the next start
        drafter = Path(args.drafter)
        if drafter.suffix != ".gguf":  # a drafter directory of any kind: its kind's GGUF writer
            from draftsmith.stages.export.block_readers import is_block_drafter

            if is_block_drafter(drafter):
                from draftsmith.stages.export.block_kind import export_block_any

                drafter = export_block_any(drafter, Path(tmp) / "drafter.gguf", "gguf", dtype="fp32",
                                           target=target_gguf).path
            else:
                from draftsmith.stages.export.gguf import export_gguf

                drafter = export_gguf(drafter, Path(tmp) / "drafter.gguf", target=target_gguf, dtype="fp32").path
        report = run_llamacpp_bench(target_gguf, drafter, tokenizer, prompt_sets, ks, ngram_ks,
                                    args.max_new_tokens, args.threads, args.progress, verbose=args.verbose)
    report.update({"leaked_prompts": leaked} if leaked else {})  # as bench's own report says it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_llamacpp_table(report)
    atomic_write(out / "bench-llamacpp.json", json.dumps(report, indent=1).encode())
    atomic_write(out / "bench-llamacpp.txt", (table + "\n").encode())
    print(json.dumps(report) if args.json else table)
    print(f"wrote {out / 'bench-llamacpp.json'}, {out / 'bench-llamacpp.txt'}", file=sys.stderr)
    return 0
