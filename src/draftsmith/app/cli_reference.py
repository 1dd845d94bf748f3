"""docs/cli.md, rendered from the parser itself: every command, every flag, its help text, so the reference
cannot drift from the CLI (tests/test_docs.py compares the committed file with this output).

Regenerate with ``make docs`` (``python -m draftsmith.app.cli_reference > docs/cli.md``).
"""

from __future__ import annotations

import argparse
import sys

from draftsmith.app.cli import build_parser

REGENERATE = "make docs  (python -m draftsmith.app.cli_reference > docs/cli.md)"
# A fixed width: argparse wraps usage lines to the terminal's width otherwise, and the file must not depend on it.
USAGE_WIDTH = 100


def _subcommands(parser: argparse.ArgumentParser) -> tuple[dict[str, argparse.ArgumentParser], dict[str, str]]:
    """The sub-parsers in the order they were added, and each one's one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return dict(action.choices), helps
    return {}, {}


def _usage(p: argparse.ArgumentParser) -> str:
    formatter = p.formatter_class(prog=p.prog, width=USAGE_WIDTH)
    formatter.add_usage(p.usage, p._actions, p._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest
    takes_value = action.nargs != 0
    if not takes_value:
        return ", ".join(action.option_strings)
    if action.metavar is not None:
        value = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        value = action.dest.upper()
    if action.nargs == "?":
        value = f"[{value}]"
    return f"{', '.join(action.option_strings)} {value}"


def _help(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = ""
    if action.help:
        text = p._get_formatter()._expand_help(action)
    text = " ".join(text.split())
    takes_value = action.option_strings and action.nargs != 0
    default = action.default
    no_default = default is None or default is False or default == [] or default == argparse.SUPPRESS
    if takes_value and not no_default and "default" not in text.lower():
        text = f"{text} (default {action.default})" if text else f"(default {action.default})"
    if action.required and action.option_strings:
        text = f"required. {text}" if text else "required"
    return text or "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _command(name: str, p: argparse.ArgumentParser, one_line: str) -> list[str]:
    lines = [f"## draftsmith {name}", ""]
    if one_line:
        lines += [one_line[0].upper() + one_line[1:] + ("" if one_line.endswith(".") else "."), ""]
    if p.description:
        lines += [" ".join(p.description.split()), ""]
    lines += ["```", _usage(p), "```", ""]
    for group in p._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "options"
        if title not in ("options", "optional arguments"):
            lines += [f"*{title}*", ""]
        lines += ["| flag | what it does |", "|---|---|"]
        lines += [f"| `{_cell(_flag(a))}` | {_cell(_help(p, a))} |" for a in actions]
        lines.append("")
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole reference as Markdown."""
    parser = parser or build_parser()
    commands, helps = _subcommands(parser)
    lines = [
        "# Command-line reference",
        "",
        "<!-- Generated from the parser by `python -m draftsmith.app.cli_reference`; do not edit by hand: "
        "`make docs` rewrites it. -->",
        "",
        " ".join((parser.description or "").split()),
        "",
        "| command | what it does |",
        "|---|---|",
        *(f"| [`{n}`](#draftsmith-{n}) | {_cell(helps.get(n, ''))} |" for n in commands),
        "",
    ]
    for name, p in commands.items():
        lines += _command(name, p, helps.get(name, ""))
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
