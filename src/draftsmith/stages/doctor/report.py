"""What doctor reports: findings (stable id, severity, evidence, fix) and the report that gathers them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from draftsmith.core.errors import DraftsmithError

SEVERITIES = ("error", "warning", "info")
ENGINES = ("vllm", "sglang", "draftsmith", "llamacpp", "openvino")


class DoctorUsageError(DraftsmithError, ValueError):
    """Arguments doctor cannot work with (no such directory, unknown engine): exit code 2."""


@dataclass
class Finding:
    id: str
    severity: str
    message: str
    evidence: str
    fix: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DoctorReport:
    target: str
    drafter: str | None
    engine: str
    engine_version: str | None  # the version checked against (installed or stated); None = assumed latest
    engine_profile: str | None  # name of the facts profile used (vLLM)
    engine_source: str  # installed | stated | assumed | n/a
    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was not checked, and why (no finding: nothing is wrong)
    seconds: float = 0.0

    @property
    def blocking(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    @property
    def exit_code(self) -> int:
        return 1 if self.blocking else 0

    def ids(self, severity: str | None = None) -> list[str]:
        return [f.id for f in self.findings if severity is None or f.severity == severity]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["blocking"] = self.blocking
        d["exit_code"] = self.exit_code
        return d

    def summary(self) -> str:
        f = self.facts
        lines = [f"draftsmith doctor: target {self.target} ({f.get('architecture', '?')}, "
                 f"{f.get('num_layers', '?')} layers, hidden {f.get('hidden_size', '?')}, "
                 f"vocab {f.get('vocab_size', '?')})"]
        if self.drafter:
            lines.append(f"  drafter {self.drafter} ({f.get('drafter_format', '?')} layout, aux layers "
                         f"{f.get('aux_layer_ids', '?')}, draft vocab {f.get('draft_vocab_size', '?')})")
        eng = self.engine
        if self.engine == "vllm":
            eng += f" {self.engine_version or '(not installed)'}: {self.engine_profile} facts, {self.engine_source}"
        elif self.engine == "llamacpp":
            eng += f" ({self.engine_version or 'xllamacpp not installed'}; facts checked against xllamacpp 2026.10)"
        elif self.engine == "openvino":
            eng += " (facts checked against openvino-genai 2026.4.1 with optimum-intel 2.2.0)"
        lines.append(f"  engine {eng}")
        order = {s: i for i, s in enumerate(SEVERITIES)}
        for x in sorted(self.findings, key=lambda x: order[x.severity]):
            lines.append(f"{x.severity.upper():7} {x.id}: {x.message}")
            lines.append(f"        evidence: {x.evidence}")
            if x.fix:
                lines.append(f"        fix: {x.fix}")
        lines += [f"NOTE    {note}" for note in self.notes]
        n = {s: sum(x.severity == s for x in self.findings) for s in SEVERITIES}
        verdict = "would fail at load or accept ~nothing" if self.blocking else "nothing blocks"
        lines.append(f"{n['error']} error(s), {n['warning']} warning(s), {n['info']} info; {verdict} "
                     f"(exit {self.exit_code}, {self.seconds:.1f} s)")
        return "\n".join(lines)


class Findings:
    """Where the checks put what they find, into one report.

    ``cap_errors``: the vLLM version is not tabulated, so errors that rest on its facts table become warnings.
    """

    def __init__(self, report: DoctorReport):
        self.report = report
        self.cap_errors = False

    def add(self, id: str, severity: str, message: str, evidence: str, fix: str = "", *,
            engine_fact: bool = False) -> None:
        if engine_fact and self.cap_errors and severity == "error":
            severity = "warning"
            message += " (engine version not tabulated: may not apply)"
        self.report.findings.append(Finding(id, severity, message, evidence, fix))

    def note(self, text: str) -> None:
        """Something doctor did not check (e.g. weights absent from a metadata-only download): said, not an error."""
        self.report.notes.append(text)

    @property
    def facts(self) -> dict:
        return self.report.facts


__all__ = ["ENGINES", "SEVERITIES", "DoctorReport", "DoctorUsageError", "Finding", "Findings"]
