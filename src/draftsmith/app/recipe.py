"""``--config RECIPE.toml``: one TOML file, a section per command, read as that command's defaults.

A recipe holds a whole run (``[generate]``, ``[capture]``, ``[train]``, ``[export]``, ``[doctor]``, ``[serve]``,
...). Each command reads its own section; explicit flags win. Keys are the flag names in snake_case (or
kebab-case, or the argparse dest); ``flag = true`` stands for a bare switch. Everything is decided here, at the
CLI edge, against the real parser, so a key is valid exactly when the command has that flag. ``train`` reads
its section with ``load_config`` (``stages/train/config.py``: its config file predates recipes and may be flat),
after ``train_section`` checked the recipe's sections as here.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from pathlib import Path

from draftsmith.core.errors import UsageError


class RecipeError(UsageError):
    """A recipe that cannot be applied: unreadable TOML, an unknown section or key, a value of the wrong kind."""


def add_config_flags(sub: argparse._SubParsersAction) -> None:
    """Give every command a ``--config`` (train keeps its own, which also takes flat TOML/YAML files)."""
    for name, p in sub.choices.items():
        if not _has_own_config(p):
            p.add_argument("--config", default=None, metavar="RECIPE.toml",
                           help=f"a recipe: its [{name}] section gives this command's defaults; flags given "
                                "here win (recipes/ has examples)")
            p._recipe_config = True  # type: ignore[attr-defined]  # ours: apply_recipe reads it for this command


def apply_recipe(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Set the defaults of the command in ``argv`` from its recipe section; return the argv to parse.

    The argv comes back unchanged unless the section fills a trailing positional (serve's ``vllm_args``),
    which argparse would not take as a default.
    """
    command, path = _scan(argv)
    sub = _subparsers(parser).get(command or "")
    if sub is None or path is None or _has_own_config(sub) or _wants_help(argv):
        return argv  # --help prints the command's flags: it needs no recipe, and a recipe without its section
        #              (or a broken one) must not hide the help
    section = _section(path, command)
    where = f"{path} [{command}]"
    keys = _keys(sub)
    given = _given_options(argv)
    defaults: dict = {}
    chosen: dict[str, str] = {}  # dest -> the key that set it, to report a key given twice
    trailing: list[str] | None = None
    for key, value in section.items():
        name = str(key).replace("-", "_")
        if name not in keys:
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f"; did you mean {close[0]} ({_flag_of(keys[close[0]][0], close[0])})?" if close else ""
            raise RecipeError(f"{where}: unknown key {key!r}: `draftsmith {command}` has no such flag{hint}")
        action, negated = keys[name]
        if action.dest in chosen:
            raise RecipeError(f"{where}: {key!r} and {chosen[action.dest]!r} set the same flag")
        chosen[action.dest] = str(key)
        if action.nargs == argparse.REMAINDER:
            trailing = _strings(value, where, key)
            continue
        if any(opt in given for opt in action.option_strings):
            continue  # given on the command line: it wins (and an appended list must not add to the recipe's)
        converted = _convert(action, value, negated, name, where)
        if converted is not _UNSET:
            defaults[action.dest] = converted
    _settle_groups(sub, defaults, given, where)
    for action in sub._actions:
        if action.dest in defaults:
            action.required = False
    sub.set_defaults(**defaults)
    if trailing is not None and "--" not in argv:
        return [*argv, "--", *trailing]
    return argv


def train_section(path: str | None) -> dict | None:
    """``train --config FILE`` when FILE is a recipe (TOML with ``[command]`` tables): its ``[train]`` section,
    read by the rules every command's section is (known sections only, the section present). None: no file, or
    a flat train config (TOML or YAML fields), which ``load_config`` reads itself."""
    if path is None or Path(path).suffix in (".yaml", ".yml") or not Path(path).is_file():
        return None
    try:
        values = tomllib.loads(Path(path).read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
        return None  # load_config names the file and the error
    if not any(isinstance(v, dict) for v in values.values()):
        return None
    return _section(path, "train")


def recipe_keys(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """The keys a ``[command]`` section may hold (tests and docs list them)."""
    return sorted(_keys(_subparsers(parser)[command]))


# --- pieces ---------------------------------------------------------------------------------------------------
_UNSET = object()


def _has_own_config(p: argparse.ArgumentParser) -> bool:
    return any("--config" in a.option_strings for a in p._actions) and not getattr(p, "_recipe_config", False)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _scan(argv: list[str]) -> tuple[str | None, str | None]:
    """(the command, the recipe path) from a raw argv, before argparse sees it (it would demand the flags the
    recipe supplies). The command is the first word; options end at ``--``."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is None:
        return None, None
    rest = argv[argv.index(command) + 1:]
    rest = rest[: rest.index("--")] if "--" in rest else rest
    path = None
    for i, arg in enumerate(rest):
        name, eq, value = arg.partition("=")
        if name == "--config":  # the exact flag: the parsers take no abbreviations (args.Parser)
            path = value if eq else (rest[i + 1] if i + 1 < len(rest) else None)
    return command, path


def _wants_help(argv: list[str]) -> bool:
    words = argv[: argv.index("--")] if "--" in argv else argv
    return "-h" in words or "--help" in words


def _given_options(argv: list[str]) -> set[str]:
    """Option strings written on the command line (``--x v``, ``--x=v``; before any ``--``)."""
    given = set()
    for arg in argv:
        if arg == "--":
            break
        if arg.startswith("-"):
            given.add(arg.partition("=")[0])
    return given


def _section(path: str, command: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such recipe file")
    try:
        values = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: not valid TOML ({e})") from e
    commands = set(_COMMANDS)
    for name, value in values.items():
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: top-level key {name!r} is not a [command] section (a recipe holds "
                              "[generate], [capture], [train], ... sections)")
        if name not in commands:
            close = difflib.get_close_matches(name, sorted(commands), n=1)
            raise RecipeError(f"{path}: unknown section [{name}]" + (f"; did you mean [{close[0]}]?" if close else ""))
    if command not in values:
        raise RecipeError(f"{path}: no [{command}] section (it has {', '.join(f'[{k}]' for k in values) or 'none'})")
    return values[command]


# Every command a recipe may hold a section for (the parser is the authority; this list only names sections).
_COMMANDS = ("decode", "generate", "capture", "vocab", "train", "export", "import", "doctor", "serve", "bench", "demo")


def _keys(p: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """key -> (action, negated): each long flag in snake_case, then each dest not already a key."""
    keys: dict[str, tuple[argparse.Action, bool]] = {}
    skip = (argparse._HelpAction, argparse._VersionAction)
    actions = [a for a in p._actions if not isinstance(a, skip) and a.dest != "config"]
    for action in actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                name = opt[2:].replace("-", "_")
                negated = isinstance(action, argparse.BooleanOptionalAction) and opt.startswith("--no-")
                keys[name] = (action, negated)
    for action in actions:
        keys.setdefault(action.dest, (action, False))
    return keys


def _flag_of(action: argparse.Action, key: str) -> str:
    longs = [o for o in action.option_strings if o.startswith("--")]
    want = "--" + key.replace("_", "-")
    return want if want in longs else (longs[0] if longs else action.dest)


def _convert(action: argparse.Action, value, negated: bool, key: str, where: str):
    """The value argparse would have produced for this flag, or ``_UNSET`` for a switch set to false."""
    if action.nargs == 0:  # a switch: store_true/false/const or --x/--no-x
        if not isinstance(value, bool):
            raise RecipeError(f"{where}: {key} is a switch: write {key} = true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return not value if negated else value
        if key == action.dest and not any(o[2:].replace("-", "_") == key for o in action.option_strings):
            return value  # the dest itself (e.g. progress = false for --no-progress)
        return action.const if value else _UNSET
    if isinstance(action, argparse._AppendAction):
        return [_scalar(action, v, key, where) for v in (value if isinstance(value, list) else [value])]
    return _scalar(action, value, key, where)


def _scalar(action: argparse.Action, value, key: str, where: str):
    if isinstance(value, bool | dict):
        raise RecipeError(f"{where}: {key} takes a value, not {value!r}")
    if isinstance(value, list):  # aux_layers = [2, 4, 5] for "2,4,5"
        if action.type not in (None, str):
            raise RecipeError(f"{where}: {key} takes one value, not a list")
        value = ",".join(str(v) for v in value)
    kind = action.type or str
    base = getattr(kind, "base_type", kind)  # a checking type (args.finite_float) names the value it takes
    if base is float and isinstance(value, int):
        value = float(value)
    elif base is str and isinstance(value, int | float):
        value = str(value)
    elif not isinstance(value, str) and not isinstance(value, base):
        raise RecipeError(f"{where}: {key} wants {getattr(base, '__name__', 'a value')}, not {value!r}")
    if kind is not str and (isinstance(value, str) or base is not kind):  # the command line's checks, here too
        try:
            value = kind(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise RecipeError(f"{where}: {key} = {value!r}: {e}") from e
    if action.choices is not None and value not in action.choices:
        raise RecipeError(f"{where}: {key} = {value!r}: choose from {', '.join(map(str, action.choices))}")
    return value


def _strings(value, where: str, key: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in items):
        raise RecipeError(f"{where}: {key} is a list of command-line words")
    return [str(v) for v in items]


def _settle_groups(p: argparse.ArgumentParser, defaults: dict, given: set[str], where: str) -> None:
    """Mutually exclusive flags: one given on the command line replaces the recipe's choice among them; two in
    the recipe are an error; a recipe's choice satisfies a required group."""
    for group in p._mutually_exclusive_groups:
        members = group._group_actions
        from_recipe = [a for a in members if a.dest in defaults]
        if any(o in given for a in members for o in a.option_strings):
            for a in from_recipe:
                del defaults[a.dest]
            continue
        if len(from_recipe) > 1:
            names = " and ".join(a.dest for a in from_recipe)
            raise RecipeError(f"{where}: {names} exclude each other; keep one")
        if from_recipe:
            group.required = False
