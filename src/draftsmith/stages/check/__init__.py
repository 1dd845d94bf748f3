"""``draftsmith check``: the measured twin of doctor. The pair is decoded in the engine, and its own counters are
compared with what the drafter should accept.

Steps: doctor (from the files; a blocking finding stops here unless forced); the served files against the
drafter's card (``drafter_card.json``: what was trained); the engine decodes the prompts plain and speculative
(greedy); draftsmith's own decoder decodes the same prompts (the reference, where it can load the pair; else the
card's held-out number); the verdict; on a loss, the faulty readings are replayed to name the cause
(``signatures``). Output equality with plain is checked, near-tie flips told apart (``verdict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import process_temp_dir
from draftsmith.stages.check.engines import EngineOutcome, run_llamacpp, run_openvino, run_sglang, run_vllm
from draftsmith.stages.check.signatures import (
    CAUSES,
    cause_of_replay,
    causes_from_card,
    causes_from_doctor,
    nearest_replay,
)
from draftsmith.stages.check.verdict import (
    COLLAPSE,
    MIN_GAIN,
    Equality,
    acceptance_verdict,
    compare_outputs,
    far_above,
    gain_ratio,
)
from draftsmith.stages.export.card import expected_at_k

ENGINES = ("vllm", "llamacpp", "openvino", "sglang")


class EngineUnusable(DraftsmithError, RuntimeError):
    """The engine failed without the drafter too (its environment, its install, the target): not a finding about
    the drafter, so no exit 1."""


@dataclass
class CheckOptions:
    engine: str
    target: str  # as the engine loads it: a .gguf (or 'smollm2') for llama.cpp, a directory or hub id for vLLM
    drafter: str  # as served: a .gguf or an engine-layout folder; draftsmith's own layout is exported first
    prompts: list[list[int]]
    prompt_source: str = ""
    k: int = 3
    max_new_tokens: int = 64
    draftsmith_target: str | None = None  # what draftsmith's decoder loads (default: target)
    reference_drafter: str | None = None  # draftsmith-readable drafter behind a .gguf (for the reference/replays)
    vllm_python: str | None = None
    vllm_dtype: str = "float32"
    kv_cache_bytes: int | None = 64 << 20
    threads: int = 1
    openvino_python: str | None = None  # OpenVINO's environment (default .venv-openvino)
    sglang_python: str | None = None  # SGLang's environment (a GPU machine's; not run here)
    force: bool = False
    replay: bool = True
    on_doctor: Callable[[str], None] | None = None  # doctor's report as soon as it is made (the engine runs on)


@dataclass
class Finding:
    cause: str
    evidence: str

    def to_dict(self) -> dict:
        c = CAUSES[self.cause]
        return {"cause": self.cause, "title": c.title, "fix": c.fix, "evidence": self.evidence}


@dataclass
class CheckReport:
    engine: str
    engine_version: str = "?"
    doctor: str = ""
    doctor_blocking: bool = False
    served_tau: float | None = None
    own_tau: float | None = None
    card_tau: float | None = None
    card_k: int | None = None  # the k the card's number is for (below ``k`` when the card holds no number for k)
    expected_from: str = ""
    verdict: str = "not run"
    findings: list[Finding] = field(default_factory=list)
    replays: dict[str, float] = field(default_factory=dict)
    equality: Equality | None = None
    notes: list[str] = field(default_factory=list)
    prompts: int = 0
    k: int = 0
    served_per_prompt: list[int] = field(default_factory=list)
    own_per_prompt: list[int] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0: served as trained; 1: a finding (a loss, a divergence, files that are not what was trained, a
        reference that accepts nothing to compare with)."""
        bad_output = self.equality is not None and bool(self.equality.divergences)
        return 0 if self.verdict == "pass" and not self.findings and not bad_output else 1

    @property
    def expected_tau(self) -> float | None:
        return self.own_tau if self.expected_from == "draftsmith" else self.card_tau

    def to_dict(self) -> dict:
        eq = self.equality
        return {"engine": self.engine, "engine_version": self.engine_version, "verdict": self.verdict,
                "exit_code": self.exit_code, "served_tau": self.served_tau, "expected_tau": self.expected_tau,
                "expected_from": self.expected_from, "draftsmith_tau": self.own_tau, "card_tau": self.card_tau,
                "k": self.k, "prompts": self.prompts, "doctor_blocking": self.doctor_blocking,
                "served_accepted_per_prompt": self.served_per_prompt,
                "draftsmith_accepted_per_prompt": self.own_per_prompt,
                "findings": [f.to_dict() for f in self.findings], "replays": self.replays,
                "equality": None if eq is None else {"compared": eq.compared, "identical": eq.identical,
                                                     "near_ties": eq.near_ties, "divergences": eq.divergences},
                "notes": self.notes}

    def card_record(self, prompt_source: str) -> dict:
        """This check as the card records it (``check --record``, on a pass)."""
        import datetime

        return {"engine": self.engine, "version": self.engine_version, "k": self.k, "prompts": self.prompts,
                "prompt_source": prompt_source, "served_tau": round(self.served_tau or 1.0, 4),
                "expected_tau": round(self.expected_tau or 0.0, 4), "expected_from": self.expected_from,
                "draftsmith_tau": None if self.own_tau is None else round(self.own_tau, 4),
                "date": datetime.datetime.now(datetime.UTC).date().isoformat()}

    def summary(self) -> str:
        lines = [f"draftsmith check --engine {self.engine} ({self.engine} {self.engine_version}), chain k={self.k}, "
                 f"{self.prompts} prompts, greedy"]
        if self.served_tau is not None:
            exp = self.expected_tau
            share = (f"; {100 * gain_ratio(self.served_tau, exp):.0f}% of its accepted drafts"
                     if exp is not None and exp - 1.0 >= MIN_GAIN else "; it accepts ~nothing")
            lines.append(f"  served acceptance length {self.served_tau:.3f}" + (
                f"; expected {exp:.3f} ({self.expected_from}{share})" if exp is not None else ""))
            if self.own_tau is not None and self.card_tau is not None:
                lines.append(f"  draftsmith's decoder on these prompts {self.own_tau:.3f}; the card (held-out "
                             f"training samples) {self.card_tau:.3f}")
        eq = self.equality
        if eq is not None:
            lines.append(f"  output equal to plain on {eq.identical}/{eq.compared} prompts"
                         + (f"; near-tie flips {len(eq.near_ties)} (the target's two best within "
                            f"rounding: {'; '.join(eq.near_ties[:3])})" if eq.near_ties else "")
                         + (f"; DIVERGED {len(eq.divergences)}: {'; '.join(eq.divergences[:3])}"
                            if eq.divergences else ""))
        for f in self.findings:
            c = CAUSES[f.cause]
            lines += [f"  likely cause: {c.title}", f"    evidence: {f.evidence}", f"    fix: {c.fix}"]
        if self.replays:
            lines.append("  replayed in draftsmith: " + ", ".join(f"{k} {v:.2f}" for k, v in self.replays.items()))
        lines += [f"  note: {n}" for n in self.notes]
        word = {"pass": "served as trained", "silent collapse": "SILENT COLLAPSE", "partial loss": "PARTIAL LOSS",
                "files differ from the card": "FILES DIFFER FROM THE CARD",
                "cannot tell": "CANNOT TELL (the reference accepts nothing to compare with)",
                "above the reference": "FAR ABOVE THE REFERENCE",
                "intermittent zero acceptance": "INTERMITTENT ZERO ACCEPTANCE (the engine's)"}
        lines.append(f"verdict: {word.get(self.verdict, self.verdict)} (exit {self.exit_code})")
        return "\n".join(lines)


def run_check(opts: CheckOptions) -> CheckReport:
    """Doctor, the card comparison, the engine, the reference, the verdict and its cause."""
    if opts.engine not in ENGINES:
        raise ValueError(f"unknown engine {opts.engine!r}; choose one of {', '.join(ENGINES)}")
    report = CheckReport(engine=opts.engine, prompts=len(opts.prompts), k=opts.k)
    # named after this process: the one a kill -9 left is removed at the next start (SIGTERM: sigterm_as_exit)
    with process_temp_dir("draftsmith-check-") as tmp:
        served = _engine_files(opts, tmp)
        if not _doctor(opts, served, report) and not opts.force:  # doctor reads what the engine will load
            report.verdict = "refused by doctor"
            return report
        card = _card(opts)
        _card_findings(opts, served, card, report)
        outcome = _run_engine(opts, served)
        report.engine_version = outcome.version
        if outcome.plain.error:  # no drafter in that run: the engine, its environment or the target failed
            raise EngineUnusable(f"{opts.engine} could not decode without a drafter either, so the drafter is not "
                                 f"what failed: {' '.join(outcome.plain.error.split())[:300]} (check the engine's "
                                 "environment, e.g. --sglang-python / --vllm-python, and the target)")
        if outcome.spec.error:
            report.verdict = "engine refused"
            report.notes.append(f"{opts.engine}: {outcome.spec.error}")
            return report
        report.served_tau = outcome.spec.tau
        report.served_per_prompt = list(outcome.spec.per_prompt)
        if card is not None:
            report.card_tau, report.card_k = expected_at_k(card, opts.k)
            if report.card_tau is not None and report.card_k != opts.k:
                report.notes.append(f"the card holds no number for k={opts.k}: its k={report.card_k} number "
                                    f"({report.card_tau:.2f}) is the bar, a floor at k={opts.k} (a longer chain "
                                    "accepts at least as much)")
        pair = _reference(opts, report)
        top = outcome.plain.top
        if top is None and pair is not None:  # the engine gives no log-probabilities: the target's own, in draftsmith
            from draftsmith.stages.check.replay import plain_top2

            top = plain_top2(pair[0], opts.prompts, outcome.plain.token_ids, outcome.spec.token_ids)
        report.equality = compare_outputs(outcome.plain.token_ids, outcome.spec.token_ids, top)
        _decide(opts, report, pair, outcome)
        _zero_acceptance(report, outcome)
    return report


def _doctor(opts: CheckOptions, served: Path, report: CheckReport) -> bool:
    """Doctor first, on the files the engine loads; False when it blocks (its causes become findings)."""
    from draftsmith.stages.doctor import diagnose

    try:
        d = diagnose(opts.target, served, engine=opts.engine)
    except Exception as e:  # noqa: BLE001 - doctor cannot read this pair (a hub id offline, a layout it skips)
        report.notes.append(f"doctor could not run: {' '.join(str(e).split())[:200]}")
        return True
    report.doctor = d.summary()
    if opts.on_doctor is not None:
        opts.on_doctor(report.doctor)
    report.doctor_blocking = d.blocking
    flagged = d.ids("error") + d.ids("warning")
    for cause in causes_from_doctor(flagged):
        named = ", ".join(i for i in flagged if i in CAUSES[cause].doctor_ids)
        report.findings.append(Finding(cause, f"doctor: {named}"))
    if d.blocking:
        report.notes.append("doctor found what fails at load or accepts ~nothing (--force runs the engine anyway)")
    return not d.blocking


def _engine_files(opts: CheckOptions, tmp: Path) -> Path:
    """The drafter as the engine loads it: as given, or exported from draftsmith's own layout."""
    p = Path(opts.drafter)
    if opts.engine == "openvino":
        from draftsmith.core.openvino_facts import DRAFT_XML

        if (p / DRAFT_XML).is_file():
            return p
        from draftsmith.stages.export.openvino import export_openvino

        return export_openvino(p, tmp / "openvino", target=opts.target, python=opts.openvino_python).path
    if opts.engine == "llamacpp":
        if p.suffix == ".gguf":
            return p
        from draftsmith.stages.export.gguf import export_gguf

        return export_gguf(p, tmp / "drafter.gguf", target=opts.target, dtype="fp32").path
    from draftsmith.stages.export import detect_format, export_drafter

    if detect_format(p) in ("vllm", "speculators", "sglang"):
        return p
    if opts.engine == "sglang":  # SGLang's own numbering of the tapped layers (eagle_config)
        return export_drafter(p, tmp / "sglang", "sglang", dtype="fp32").path
    return export_drafter(p, tmp / "vllm", "vllm", dtype="fp32").path


def _card(opts: CheckOptions) -> dict | None:
    """The drafter's card; for a draftsmith drafter folder without one, its facts made on the spot (the run's
    eval.json gives the expectation), so the files the engine loads are still compared with what was trained."""
    from draftsmith.stages.export.card import card_facts, read_card

    for where in (opts.drafter, opts.reference_drafter):
        if where and (card := read_card(where)) is not None:
            return card
    for where in (opts.reference_drafter, opts.drafter):
        if where and Path(where).is_dir() and (Path(where) / "config.json").is_file():
            from draftsmith.stages.export import detect_format, read_checkpoint

            if detect_format(Path(where)) != "draftsmith":
                continue
            ckpt = read_checkpoint(where)
            return card_facts(fmt="draftsmith", out=where, drafter_config=ckpt.config, source=where,
                              base_model=None, num_speculative_tokens=opts.k, files=[], d2t=ckpt.state.get("d2t"))
    return None


def _card_findings(opts: CheckOptions, served: Path, card: dict | None, report: CheckReport) -> None:
    from draftsmith.stages.check.files import served_facts

    if card is None:
        report.notes.append("the drafter carries no card (drafter_card.json): the served files cannot be compared "
                            "with what was trained; draftsmith's decoder is the reference")
        return
    target = opts.target if opts.engine in ("vllm", "openvino", "sglang") else None
    for cause, evidence in causes_from_card(card, served_facts(served, opts.engine, target, opts.openvino_python)):
        report.findings.append(Finding(cause, evidence))


def _run_engine(opts: CheckOptions, served: Path) -> EngineOutcome:
    if opts.engine == "llamacpp":
        from draftsmith.model.sources import EMBEDDED_DEFAULT, smollm2_gguf_path

        target = smollm2_gguf_path() if opts.target == EMBEDDED_DEFAULT else Path(opts.target)
        return run_llamacpp(target, served, opts.prompts, opts.k, opts.max_new_tokens, opts.threads)
    if opts.engine == "openvino":
        from transformers import AutoTokenizer

        from draftsmith.data.chat import stop_token_ids
        from draftsmith.stages.export.openvino import openvino_target, target_source_dir

        eos = stop_token_ids(AutoTokenizer.from_pretrained(target_source_dir(opts.target)))
        target_ir = openvino_target(opts.target, python=opts.openvino_python)
        return run_openvino(target_ir, served, opts.prompts, opts.k, opts.max_new_tokens, eos=eos,
                            threads=opts.threads, python=opts.openvino_python)
    if opts.engine == "sglang":
        if not opts.sglang_python:
            raise ValueError("check --engine sglang needs SGLang's Python (--sglang-python)")
        return run_sglang(opts.sglang_python, opts.target, served, opts.prompts, opts.k, opts.max_new_tokens)
    if not opts.vllm_python:
        raise ValueError("check --engine vllm needs vLLM's Python (--vllm-python)")
    return run_vllm(opts.vllm_python, opts.target, served, opts.prompts, opts.k, opts.max_new_tokens,
                    dtype=opts.vllm_dtype, kv_cache_bytes=opts.kv_cache_bytes)


def _reference(opts: CheckOptions, report: CheckReport):
    """draftsmith's decoder on the same prompts: its acceptance length into the report; the loaded pair (or None)."""
    from draftsmith.core.openvino_facts import DRAFT_XML
    from draftsmith.stages.check.replay import chain_runs, load_pair, tau_of

    served_only = Path(opts.drafter).suffix == ".gguf" or (Path(opts.drafter) / DRAFT_XML).is_file()
    source = opts.reference_drafter or (None if served_only else opts.drafter)
    if source is None:
        report.notes.append("a .gguf or OpenVINO IR drafter without --reference-drafter DIR: draftsmith's decoder "
                            "cannot replay it")
        return None
    try:
        target, drafter = load_pair(opts.draftsmith_target or opts.target, source)
    except Exception as e:  # noqa: BLE001 - a target draftsmith cannot load: the card is the reference
        report.notes.append(f"draftsmith's decoder cannot load the pair ({' '.join(str(e).split())[:160]}); "
                            "pass --draftsmith-target DIR")
        return None
    # llama.cpp and GenAI stop at end of generation; vLLM's check ignores it
    eos = _stops(target) if opts.engine in ("llamacpp", "openvino", "sglang") else ()
    runs = chain_runs(target, drafter, opts.prompts, opts.k, opts.max_new_tokens, eos)
    report.own_tau = tau_of(runs)
    report.own_per_prompt = [acc for acc, _, _ in runs]
    return target, drafter, eos


def _stops(target) -> list[int]:
    from draftsmith.data.chat import stop_token_ids

    return list(stop_token_ids(target.tokenizer)) if target.tokenizer is not None else []


def _decide(opts: CheckOptions, report: CheckReport, pair, outcome: EngineOutcome) -> None:
    """The verdict against the reference, then the cause of any loss."""
    served = report.served_tau
    card_found = bool(report.findings)
    if report.own_tau is not None:
        report.expected_from = "draftsmith"
        report.verdict = acceptance_verdict(served, report.own_tau, "draftsmith", report.engine)
        if report.card_tau is not None and gain_ratio(report.own_tau, report.card_tau) < COLLAPSE:
            # The engine reads the files as draftsmith does, and both accept far less than the card promises.
            report.verdict = "silent collapse"
            if not card_found:
                report.findings.append(Finding("wrong-target", f"draftsmith's own decoder accepts "
                                               f"{report.own_tau:.2f} on these prompts, the card "
                                               f"{report.card_tau:.2f}: "
                                               "the drafter does not fit this target (or these prompts are far "
                                               "from its training data)"))
    elif report.card_tau is not None:
        report.expected_from = "card"
        report.verdict = acceptance_verdict(served, report.card_tau, "card")
    else:
        report.verdict = "unchecked"
        report.notes.append("no reference acceptance: no card and no draftsmith decode")
        return
    if report.verdict == "cannot tell":
        report.notes.append(_cannot_tell(report))
        return
    if report.verdict == "pass" and card_found and report.card_tau is not None and report.card_tau - 1 >= MIN_GAIN:
        report.verdict = acceptance_verdict(served, report.card_tau, "card")
    if report.verdict == "pass" and card_found:  # serves well here, but not what was trained (e.g. aux ids +1)
        report.verdict = "files differ from the card"
    if report.verdict != "pass" and pair is not None and opts.replay:
        from draftsmith.stages.check.replay import replay_all

        target, drafter, eos = pair
        report.replays = {k: round(v, 3) for k, v in replay_all(target, drafter, opts.prompts, opts.k,
                                                                opts.max_new_tokens, eos).items()}
        hit = nearest_replay(served, report.replays, tolerance=0.1)
        if hit is not None and gain_ratio(served, report.expected_tau) < 0.97:
            label, tau = hit
            report.findings.append(Finding(cause_of_replay(label), f"draftsmith reading the drafter with "
                                           f"'{label}' accepts {tau:.2f}; the engine {served:.2f}"))
    if report.verdict != "pass" and not report.findings:
        report.findings.append(Finding("unknown", f"served {served:.2f} against {report.expected_tau:.2f}"))
    _above(report)


def _cannot_tell(report: CheckReport) -> str:
    """Why a reference that accepts ~nothing is no pass: any served number is 100% of nothing."""
    what = (f"draftsmith's own decoder accepts ~nothing on these prompts ({report.own_tau:.2f})"
            if report.expected_from == "draftsmith" else f"the card expects ~nothing ({report.card_tau:.2f})")
    return (f"cannot tell: {what}, so a drafter that accepts nothing would pass too, and the card holds no "
            "number above it to compare with. Check with --reference-drafter DIR (the drafter as trained, with its "
            "eval.json), prompts like its training data, or a card from `draftsmith export`")


def _above(report: CheckReport) -> None:
    """A served acceptance far above the reference: flagged (the card's number for a shorter chain is only a floor
    at this k, so it flags nothing)."""
    served, exp = report.served_tau, report.expected_tau
    if report.verdict != "pass" or served is None or exp is None:
        return
    if report.expected_from == "card" and report.card_k != report.k:
        return
    if far_above(served, exp, report.expected_from):
        report.verdict = "above the reference"
        report.findings.append(Finding("above-reference", f"served {served:.2f} against {exp:.2f} "
                                       f"({report.expected_from}), {100 * gain_ratio(served, exp):.0f}% of its "
                                       "accepted drafts"))


def _zero_acceptance(report: CheckReport, outcome: EngineOutcome) -> None:
    """GenAI #4425: a freshly built speculative pipeline that accepts no draft (output unchanged) or crashes, where
    a fresh one accepts. The engine retried once (``first_try``); a zero run is the engine's fault when the retry
    accepted, and a finding either way: a deployment that builds such a pipeline serves at plain speed, silently."""
    first = outcome.first_try
    if first is None:
        return
    what = (f"crashed ({' '.join(first.error.split())[:160]})" if first.error
            else f"accepted 0 drafts in {first.passes} verify passes")
    if outcome.spec.accepted > 0:
        if report.verdict == "pass":
            report.verdict = "intermittent zero acceptance"
        report.findings.append(Finding("engine-zero-accept", f"the first speculative pipeline {what}; a fresh one "
                                       f"accepted {outcome.spec.accepted} (acceptance length "
                                       f"{outcome.spec.tau:.2f}, the verdict's)"))
    else:
        report.notes.append(f"the first speculative pipeline {what}, and a fresh one accepted nothing either: not "
                            "GenAI's intermittent zero-acceptance (#4425), the drafter as served")
