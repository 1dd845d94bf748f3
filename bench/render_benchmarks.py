"""Render docs/benchmarks.md's tables from small committed result files, so the page holds no hand-typed number.

A result file is docs/results/NAME.json: the ``bench.json`` that ``draftsmith bench --out DIR`` writes (its
``machine``, ``target``, ``dtype``, ``max_new_tokens`` and ``results``), plus three keys the bench cannot know
and a reader needs: ``date`` (YYYY-MM-DD of the run), ``command`` (the ``draftsmith bench ...`` line that ran)
and ``drafter`` (what the drafter was: its recipe or where it came from). The table goes between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, the same markers ``bench --readme docs/benchmarks.md
--readme-section NAME`` writes, in the same format; a section the page lacks is appended under a heading.

Run:
  python bench/render_benchmarks.py                 # rewrite docs/benchmarks.md from docs/results/*.json
  python bench/render_benchmarks.py --check         # exit 1 if the page is not what the files render
  cp runs/bench/bench.json docs/results/my-gpu.json # then add "date", "command", "drafter" to it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.app.bench import markdown_table, readme_markers
from draftsmith.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("date", "command", "drafter", "machine", "results", "target", "max_new_tokens")


def load_result(path: Path) -> dict:
    """A result file, checked for what the rendered section states."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable JSON result file ({e})") from e
    missing = [k for k in REQUIRED if k not in report]
    if missing:
        raise UsageError(f"{path}: missing {', '.join(missing)} (a bench.json plus date, command and drafter)")
    return report


def render_section(report: dict) -> str:
    """The table as ``bench --readme`` writes it, then the run's date and drafter."""
    table = markdown_table(report, report["command"])
    return f"{table}\nMeasured {report['date']}; drafter: {report['drafter']}."


def render_page(page: str, results: dict[str, dict]) -> str:
    """``page`` with each named section replaced by its result's rendering (appended when absent)."""
    for name, report in sorted(results.items()):
        start, end = readme_markers(name)
        body = f"{start}\n{render_section(report)}\n{end}"
        if start in page and end in page:
            head, rest = page.split(start, 1)
            _, tail = rest.split(end, 1)
            page = f"{head}{body}{tail}"
        else:
            page = f"{page.rstrip()}\n\n## {name}\n\n{body}\n"
    return page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results", help="folder of NAME.json files")
    ap.add_argument("--page", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to rewrite")
    ap.add_argument("--check", action="store_true", help="do not write: exit 1 if the page is out of date")
    args = ap.parse_args(argv)
    try:
        results = {p.stem: load_result(p) for p in sorted(args.results.glob("*.json"))}
        page = args.page.read_text()
    except (UsageError, OSError) as e:
        print(f"render_benchmarks: error: {e}", file=sys.stderr)
        return 2
    rendered = render_page(page, results)
    if args.check:
        if rendered != page:
            print(f"render_benchmarks: {args.page} is out of date: run python bench/render_benchmarks.py",
                  file=sys.stderr)
            return 1
        return 0
    if rendered != page:
        args.page.write_text(rendered)
    print(f"{args.page}: {len(results)} section(s) from {args.results}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
