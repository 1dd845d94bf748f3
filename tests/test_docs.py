"""The user docs against the code: every `draftsmith ...` command in README.md and docs/*.md parses with the real
parser, the README stays short and has what the user journeys need, docs/cli.md is what the parser renders, and
the benchmarks page renderer writes what its result files say."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from draftsmith.app import cli_reference
from draftsmith.app.cli import build_parser, parse_args

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
# The generated reference is checked against the parser as a whole (below); its usage blocks are not commands.
GENERATED = {"cli.md"}
_SEPARATORS = {"|", "||", "&&", ";", ">", ">>", "&", "<", "2>", "2>&1"}
# Code blocks read as shell: fenced with one of these languages or none. Output goes in ```text blocks.
_SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in GENERATED)]


def _argv(tokens: list[str]) -> list[str] | None:
    """The draftsmith arguments of one shell command's tokens, or None when it does not run draftsmith.

    Accepted forms: ``draftsmith ...`` (or a path ending in /draftsmith), ``python -m draftsmith.cli ...`` and
    ``torchrun ... -m draftsmith.cli ...``, after any ``VAR=value`` assignments.
    """
    i = 0
    while i < len(tokens) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", tokens[i]):
        i += 1
    rest = tokens[i:]
    if not rest:
        return None
    if rest[0] == "draftsmith" or rest[0].endswith("/draftsmith"):
        return rest[1:]
    if "-m" in rest:
        j = rest.index("-m")
        launcher = Path(rest[0]).name
        if j + 1 < len(rest) and rest[j + 1] == "draftsmith.cli" and (
                launcher.startswith("python") or launcher == "torchrun"):
            return rest[j + 2:]
    return None


def _split_commands(line: str) -> list[list[str]]:
    """A shell line's commands (split at pipes, `&&`, `;` and redirections), comments dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    commands, current = [], []
    for tok in lex:
        if tok in _SEPARATORS or set(tok) <= set("|&;<>"):
            commands.append(current)
            current = []
            if tok in (">", ">>", "<"):  # the file name after a redirection is not an argument
                current = [None]
            continue
        if current == [None]:
            current = []
            continue
        current.append(tok)
    commands.append(current)
    return [c for c in commands if c and c != [None]]


def draftsmith_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of every draftsmith command in the fenced code blocks of a Markdown text.

    Backslash continuations are joined (the command keeps its first line's number) and comments are dropped.
    """
    found = []
    in_block = shell = False
    logical, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            in_block = not in_block
            shell = in_block and raw.strip()[3:].strip().lower() in _SHELL_FENCES
            logical = ""
            continue
        if not shell:
            continue
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not logical:
            start = n
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        try:
            commands = _split_commands(logical)
        except ValueError:  # an unbalanced quote: not a shell line (prose or output inside the block)
            commands = []
        for tokens in commands:
            argv = _argv(tokens)
            # draftsmith's own messages start "draftsmith:" or "draftsmith doctor: ...": output, not a command.
            if argv is not None and not (tokens[0].endswith(":") or (argv and argv[0].endswith(":"))):
                found.append((start, argv))
        logical = ""
    return found


def parse_error(argv: list[str]) -> str | None:
    """argparse's complaint about a command line (its --config recipe applied, paths from the repo root)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(ROOT):
            parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def test_extractor_joins_continuations_strips_comments_and_finds_every_launcher():
    text = "\n".join([
        "draftsmith decode --prompt outside-a-block-is-prose",
        "```bash",
        "make demo   # not draftsmith",
        "draftsmith train --store s \\",
        "    --out r   # trailing comment --not-a-flag",
        "OMP_NUM_THREADS=1 draftsmith bench --drafter d | tee log > out.txt",
        "torchrun --nproc-per-node 8 -m draftsmith.cli train --config recipes/x.toml",
        ".venv/bin/python -m draftsmith.cli doctor --target t && echo ok",
        "python -m draftsmith.app.cli_reference > docs/cli.md",
        "draftsmith doctor: target t (LlamaForCausalLM, 8 layers)",
        "```",
        "```toml",
        "draftsmith train --no-such-flag",
        "```",
    ])
    found = draftsmith_commands(text)
    assert found == [
        (4, ["train", "--store", "s", "--out", "r"]),
        (6, ["bench", "--drafter", "d"]),
        (7, ["train", "--config", "recipes/x.toml"]),
        (8, ["doctor", "--target", "t"]),
    ]
    assert parse_error(["decode", "--no-such-flag"]) is not None
    assert parse_error(["decode", "--prompt", "hi"]) is None


def test_every_draftsmith_command_in_the_docs_parses():
    failures, count = [], 0
    for path in doc_files():
        for line, argv in draftsmith_commands(path.read_text()):
            count += 1
            error = parse_error(argv)
            if error:
                failures.append(f"{path.relative_to(ROOT)}:{line}: draftsmith {shlex.join(argv)}\n    {error}")
    assert count >= 20, f"only {count} draftsmith commands found in README.md and docs/*.md: is the extractor broken?"
    assert not failures, "commands in the docs that the parser refuses:\n" + "\n".join(failures)


def test_readme_is_short_and_covers_the_user_journeys():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the cap is {README_MAX_LINES}"
    commands = [argv for _, argv in draftsmith_commands(text)]
    assert any(a[:1] == ["doctor"] and "--target" in a for a in commands), "README: no doctor example"
    assert re.search(r"pip install [^\n]*torch[^\n]*--index-url https://download\.pytorch\.org/whl/cu", text), \
        "README: no CUDA install (torch from the CUDA index)"
    assert re.search(r"^torchrun .*-m draftsmith\.cli train", text, re.M), "README: no torchrun line"
    assert re.search(r"^vllm serve ", text, re.M), "README: no `vllm serve` line"
    assert any(a[:1] == ["export"] and "gguf" in a for a in commands), "README: no llama.cpp (GGUF) export"
    assert any(a[:1] == ["bench"] and "llamacpp" in a for a in commands), "README: no llama.cpp bench"
    assert "<!-- bench:start -->" in text and "<!-- bench:end -->" in text, "README: the bench table's markers"


def test_links_between_docs_resolve():
    missing = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_cli_reference_is_what_the_parser_renders():
    committed = (ROOT / "docs" / "cli.md").read_text()
    assert committed == cli_reference.render(), (
        f"docs/cli.md differs from the parser's rendering; regenerate it with: {cli_reference.REGENERATE}")


def test_cli_reference_lists_every_command_and_flag():
    text = cli_reference.render()
    parser = build_parser()
    commands, _ = cli_reference._subcommands(parser)
    for name, sub in commands.items():
        assert f"## draftsmith {name}\n" in text
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text or f", {option}" in text, f"{name} {option} not in the reference"


# --- bench/render_benchmarks.py --------------------------------------------------------------------------
def _renderer():
    spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "bench" / "render_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_json() -> dict:
    """A tiny bench.json of the shape `draftsmith bench --out` writes (two methods, one dataset)."""
    row = {"tokens": 100, "seconds": 2.0, "tokens_per_second": 50.0, "acceptance_length": 1.0, "verify_passes": 0,
           "accepted": 0, "prefill_time": 0.1, "draft_time": 0.0, "verify_time": 1.8, "overhead_time": 0.1,
           "step_time": 0.018, "acceptance_per_position": [], "requests": 4, "speedup": 1.0,
           "speedup_bound": None}
    chain = {**row, "tokens_per_second": 71.5, "acceptance_length": 1.83, "verify_passes": 55, "accepted": 45,
             "acceptance_per_position": [0.6, 0.23], "speedup": 1.43, "speedup_bound": 1.47,
             "identical_to_plain": "4/4", "diverged_at_tie": 0}
    return {"target": "tiny-llama", "dtype": "bfloat16", "packed": False, "max_new_tokens": 64,
            "machine": {"cpu": "Test CPU", "cores": 2, "torch_threads": 1, "torch": "2.13.0", "python": "3.11",
                        "cuda": None, "flags": ["avx2"]},
            "results": [{"dataset": "mt-bench", "temperature": 0.0, "prompts": 4,
                         "methods": {"plain": row, "eagle3 chain k=2": chain}}]}


def test_render_benchmarks_writes_each_result_into_its_section(tmp_path):
    render = _renderer()
    results = tmp_path / "results"
    results.mkdir()
    report = {**_bench_json(), "date": "2026-12-06", "drafter": "a tiny test drafter",
              "command": "draftsmith bench --target t --drafter d --chain 2 --out runs/b"}
    (results / "cpu-test.json").write_text(json.dumps(report))
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nintro\n\n<!-- cpu-test:start -->\nold table\n<!-- cpu-test:end -->\n\nafter\n")
    assert render.main(["--results", str(results), "--page", str(page), "--check"]) == 1
    assert render.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert "old table" not in text and text.startswith("# Benchmarks\n\nintro\n") and text.endswith("\n\nafter\n")
    assert "| mt-bench (4 prompts) | 0 | eagle3 chain k=2 | 1.83 | 71.5 | 1.43x | 1.47x | 4/4 (0) |" in text
    assert "machine: Test CPU, 2 cores (no AMX, no avx512_bf16), 1 torch threads, torch 2.13.0" in text
    assert "Produced by `draftsmith bench --target t --drafter d --chain 2 --out runs/b`." in text
    assert "Measured 2026-12-06; drafter: a tiny test drafter." in text
    assert render.main(["--results", str(results), "--page", str(page), "--check"]) == 0  # idempotent
    # A result with no section on the page gets one at the end.
    (results / "gpu-test.json").write_text(json.dumps({**report, "date": "2026-12-07"}))
    assert render.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert "## gpu-test\n\n<!-- gpu-test:start -->" in text and "Measured 2026-12-07" in text


def test_render_benchmarks_refuses_a_result_without_its_provenance(tmp_path, capsys):
    render = _renderer()
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.json").write_text(json.dumps(_bench_json()))  # a bare bench.json: no date, command, drafter
    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n")
    assert render.main(["--results", str(results), "--page", str(page)]) == 2
    err = capsys.readouterr().err
    assert "missing date, command, drafter" in err and len(err.strip().splitlines()) == 1
    assert page.read_text() == "# Benchmarks\n"


def test_committed_benchmark_results_render_to_the_committed_page():
    render = _renderer()
    assert render.main(["--check"]) == 0, "docs/benchmarks.md is stale: run python bench/render_benchmarks.py"


@pytest.mark.parametrize("section", ["bench"])
def test_readme_bench_section_is_one_tool_written_table(section):
    text = (ROOT / "README.md").read_text()
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    body = text.split(start, 1)[1].split(end, 1)[0]
    assert body.count("| dataset | T | method |") == 1 and "Produced by `draftsmith bench " in body
