"""Command line: argument parsing only; each command calls one function of the library."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from draftsmith import __version__
from draftsmith.app import stage_commands as stages
from draftsmith.app.args import (
    K_BOUND,
    TREE_BOUND,
    USER_ERRORS,
    Parser,
    add_device_arg,
    add_json_arg,
    add_progress_arg,
    add_target_args,
    add_vllm_args,
    check_env_switches,
    check_vllm_args,
    fail,
    fail_os,
    finite_float,
    parse_ints,
)
from draftsmith.app.check import add_check_parser
from draftsmith.app.kind_args import BLOCK_HELP, add_kind_args
from draftsmith.app.recipe import add_config_flags, apply_recipe
from draftsmith.core.allocator import keep_freed_memory
from draftsmith.core.denormals import flush_denormals
from draftsmith.core.errors import UsageError, one_line
from draftsmith.data.chat import encode_prompt, stop_token_ids


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="draftsmith",
        description="Forge EAGLE-3 speculative-decoding drafters for any LLM and prove them before deploying.",
    )
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decode", help="decode one prompt, plainly or speculatively, and report acceptance")
    add_target_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drafter", default=None, help="drafter directory (config.json + model.safetensors) of any kind")
    g.add_argument("--random-drafter", action="store_true",
                   help="an untrained drafter (acceptance near 1): measures the speculative overhead")
    add_kind_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at least 1 (default 128)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=finite_float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    s = p.add_mutually_exclusive_group()
    s.add_argument("--chain", type=int, default=None, metavar="K",
                   help=f"draft a chain of K tokens (default 3). {K_BOUND}")
    s.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help=f"EAGLE-2 dynamic tree, e.g. 5,8,48. {TREE_BOUND}")
    s.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help=f"n-gram prompt-lookup drafting of K tokens (no drafter; the free baseline). {K_BOUND}")
    s.add_argument("--shape", choices=["auto"], default=None, help="auto: the chain, tree or hybrid (or plain) "
                   "expected fastest here from measured verify costs and acceptance (cached); a block drafter: the "
                   "block length; no --dtype: fp32 or bf16, the faster")
    s.add_argument("--block", type=int, default=None, metavar="K", help=BLOCK_HELP)
    p.add_argument("--hybrid", type=int, nargs="?", const=0, default=None, metavar="K",
                   help="graft K prompt-lookup tokens (default 3) onto the --tree draft tree, verified in one pass")
    p.add_argument("--hybrid-min-ngram", type=int, default=1, metavar="N",
                   help="graft lookup only where an n-gram of at least N tokens recurs (N >= 1; default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_json_arg(p)

    stages.add_generate_parser(sub)
    stages.add_capture_parser(sub)
    stages.add_vocab_parser(sub)
    stages.add_export_parsers(sub)
    stages.add_train_parser(sub)
    _add_doctor_parsers(sub)
    add_check_parser(sub)

    p = sub.add_parser("bench", help="measure a drafter on real prompt sets against plain decoding")
    add_target_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--drafter", default=None, help="drafter directory of any kind (its config.json says which)")
    g.add_argument("--random-drafter", action="store_true",
                   help="an untrained drafter of --kind: measures the speculative overhead")
    add_kind_args(p)
    p.add_argument("--block", default=None, metavar="K[,K...]",
                   help=BLOCK_HELP + "; one row per K given, e.g. 2,4,7")
    p.add_argument("--datasets", default="mt-bench", help="comma-separated: mt-bench, humaneval, or JSONL paths")
    p.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    p.add_argument("--chain", type=int, default=None, metavar="K",
                   help=f"chain of K draft tokens (default 3 when --tree is not given). {K_BOUND}")
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help=f"EAGLE-2 dynamic tree; with --chain too, both are measured in the same run. {TREE_BOUND}")
    p.add_argument("--shape", choices=["auto"], default=None, help="auto: also the shape `decode --shape auto` picks "
                   "(see there; a hybrid comes with its bare tree); with no --dtype, in fp32 or bf16, whichever "
                   "steps faster here")
    p.add_argument("--prompt-lookup", default="3", metavar="K[,K...]",
                   help="also measure n-gram prompt lookup with K tokens, for each K given (0: skip; at most 64): "
                        "the free baseline at its best length here, e.g. 3,10")
    p.add_argument("--hybrid", type=int, nargs="?", const=0, default=None, metavar="K",
                   help="also measure --tree with K prompt-lookup tokens grafted on (default --prompt-lookup's "
                        "first, or 3)")
    p.add_argument("--hybrid-min-ngram", default=None, metavar="N[,N...]",
                   help="the hybrid grafts lookup only where an n-gram of at least N tokens recurs; one hybrid "
                        "per N given, and --shape auto's hybrid is measured at each N given too (N >= 1; default 1)")
    p.add_argument("--no-expected", dest="expected", action="store_false",
                   help="skip the expectation set beside every method (draftsmith engine: a calibration decode of "
                        "the packaged calibration prompts, cached per drafter, and the verify curve)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (N >= 1)")
    p.add_argument("--turns", type=int, default=None, help="at most N turns per prompt (MT-bench has 2; N >= 1)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at least 1 (default 128)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json, bench.txt, bench.png")
    p.add_argument("--readme", default=None, help="also write the table into this README's bench section")
    p.add_argument("--readme-section", default="bench", metavar="NAME",
                   help="the README section between <!-- NAME:start --> and <!-- NAME:end --> (default bench)")
    p.add_argument("--train-conversations", action="append", default=[], metavar="FILE",
                   help="the drafter's training conversations: warn about measured prompts found in them")
    p.add_argument("--engine", choices=["draftsmith", "llamacpp", "openvino"], default="draftsmith",
                   help="draftsmith: the in-process PyTorch decoder (default); llamacpp: llama.cpp via xllamacpp "
                        "(--target a .gguf or smollm2; --drafter a drafter .gguf or directory, exported on the fly): "
                        "plain, EAGLE-3 at each --draft-max and n-gram lookup at each --prompt-lookup, greedy; "
                        "openvino: OpenVINO GenAI in .venv-openvino (--target a Hugging Face folder or smollm2; "
                        "--drafter a draft IR or directory, converted on the fly): plain, EAGLE-3 chains at each "
                        "--draft-max and the --tree DEPTH,TOPK,TOTAL, greedy, f32, first turns")
    p.add_argument("--draft-max", default=None, metavar="K[,K...]",
                   help="llamacpp: EAGLE-3 chain lengths to measure (llama.cpp's --draft-max; default --chain or 3)")
    p.add_argument("--threads", type=int, default=1, help="llamacpp, openvino: CPU threads per engine (default 1)")
    p.add_argument("--openvino-weights", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="openvino: the target IR's weight format (converted once into draftsmith's cache; "
                        "default fp32)")
    p.add_argument("--openvino-python", default=None, metavar="PYTHON",
                   help="openvino: the Python of OpenVINO's environment (default .venv-openvino)")
    p.add_argument("--verbose", action="store_true", help="llamacpp: show llama.cpp's own log on stderr (model "
                   "loading and every request; quiet by default)")
    add_progress_arg(p)
    add_json_arg(p)

    p = sub.add_parser("demo", help="the main job: forge and measure a drafter for the embedded default",
                       description="Generate, capture, train, export and bench in one go; rerunning resumes.")
    p.add_argument("--preset", default="default", choices=["tiny", "default", "full"],
                   help="default: ~20 min on 2 CPU cores; full: longer, best numbers; tiny: seconds (tests)")
    p.add_argument("--workdir", default="runs/demo", help="where every artefact goes (default runs/demo)")
    p.add_argument("--target", default=None, help="override the preset's target (a model dir or 'smollm2')")
    p.add_argument("--minutes", type=finite_float, default=None,
                   help="wall-clock budget: training plans its steps to fit what the other stages leave (at most "
                        "the preset's step ceiling); 0: no budget, the preset's own step count (default: default 20, "
                        "full 180)")
    add_device_arg(p)
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="optional: generate self-prompted data with vLLM's engine run by this Python and print a serve "
                        "line that runs on it (e.g. .venv-vllm/bin/python; `make demo` passes it when `make vllm-env` "
                        "made it); default: the in-process backend, several times slower")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false",
                   help="skip the llama.cpp bench that follows the bench where xllamacpp is installed")
    add_progress_arg(p)
    add_json_arg(p)
    add_config_flags(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """What a command line parses to, its ``--config`` recipe applied (docs checks parse commands with it)."""
    parser = build_parser()
    return parser.parse_args(apply_recipe(parser, argv))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    try:
        argv = apply_recipe(parser, given)  # --config RECIPE: the command's section becomes its defaults
    except USER_ERRORS as e:
        return fail(e)
    except OSError as e:  # a recipe path over the name limit, a recipe one may not read
        return fail_os(e)
    args = parser.parse_args(argv)
    try:
        check_env_switches()
    except USER_ERRORS as e:
        return fail(e)
    if args.command in ("doctor", "serve"):  # before the library imports below: doctor answers in under a second
        return _doctor_or_serve(args)
    _quiet_libraries()
    keep_freed_memory()  # the commands below run the models (core/allocator.py says why)
    flush_denormals()  # before any thread pool starts (core/denormals.py says why)
    try:
        # train resolves its own device (config files name it too); llama.cpp's bench runs on the CPU and refuses
        # a --device it was given.
        engine = getattr(args, "engine", None)
        if getattr(args, "device", None) is not None and engine not in ("llamacpp", "openvino"):
            from draftsmith.core.device import resolve_device

            args.device = resolve_device(args.device)
        if args.command == "decode":
            return _decode(args)
        if args.command in ("generate", "capture", "vocab"):
            return {"generate": stages.generate, "capture": stages.capture, "vocab": stages.vocab}[args.command](args)
        if args.command in ("export", "import"):
            return {"export": stages.export, "import": stages.import_}[args.command](args)
        if args.command == "train":
            return stages.train(args)
        if args.command == "check":
            from draftsmith.app.check import check_command

            return check_command(args)
        if args.command == "bench":
            return _bench(args, given)
        if args.command == "demo":
            from draftsmith.app.demo import run_demo

            if args.minutes is not None and args.minutes < 0:
                raise UsageError(f"--minutes must be >= 0 (0: no budget), not {args.minutes:g}")
            extra = {} if args.minutes is None else {"minutes": args.minutes or None}
            result = run_demo(args.preset, args.workdir, target=args.target, progress=args.progress,
                              vllm_python=args.vllm_python, device=args.device, llamacpp=args.llamacpp, **extra)
            if args.json:
                print(json.dumps(result))
            return 0
    except USER_ERRORS as e:
        return fail(e)
    except OSError as e:  # a path too long, an --out under a file or not writable: one line, not a traceback
        return fail_os(e)
    except Exception as e:  # a corrupt weights file that no loader below named: still one line
        from safetensors import SafetensorError

        if not isinstance(e, SafetensorError):
            raise
        return fail(RuntimeError(f"not a valid safetensors file (truncated or corrupt): {one_line(e)}"))
    parser.error(f"unknown command {args.command}")
    return 2


def _bench(args, argv: list[str]) -> int:
    """``argv``: the command line as given, which the README table quotes."""
    from draftsmith.app.bench import (
        check_bench_args,
        check_readme,
        format_table,
        run_bench,
        update_readme,
        write_report,
    )
    from draftsmith.app.kind_args import drafter_kind, drafts_blocks, make_drafter
    from draftsmith.stages.block_decode import BlockSpec, resolve_block_spec
    from draftsmith.stages.decode import ChainSpec, HybridSpec, NgramSpec, SpeculativeDecoder, TreeSpec
    from draftsmith.stages.step_config import choose_for_drafting, load_target_for

    try:
        temperatures = [finite_float(t) for t in args.temperature.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise UsageError(f"--temperature wants comma-separated finite numbers, got {args.temperature!r}") from e
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--limit", args.limit), ("--turns", args.turns)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.engine == "llamacpp":
        from draftsmith.app.bench_llamacpp import bench_llamacpp_command

        if not args.drafter:
            raise UsageError("--engine llamacpp measures a saved drafter: give --drafter")
        return bench_llamacpp_command(args)
    if args.engine == "openvino":
        from draftsmith.app.bench_openvino import bench_openvino_command

        return bench_openvino_command(args)
    lookup_ks = parse_ints(args.prompt_lookup) or []
    if any(k < 0 for k in lookup_ks):
        raise UsageError(f"--prompt-lookup must be >= 0 (0 skips it), got {args.prompt_lookup}")
    lookup_ks = [k for k in lookup_ks if k]
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory (bench.json, bench.txt and bench.png go "
                         "there)")
    check_bench_args([d for d in args.datasets.split(",") if d], temperatures, limit=args.limit, turns=args.turns,
                     max_new_tokens=args.max_new_tokens, prompt_lookup_ks=lookup_ks)
    if args.readme:
        check_readme(args.readme, args.readme_section)
    if args.shape and len(set(temperatures)) > 1:
        raise UsageError("--shape auto chooses for one temperature (acceptance depends on it): give one "
                         f"--temperature, got {args.temperature}")
    kind = drafter_kind(args)
    blocks = drafts_blocks(args, kind, ("--chain", "--tree", "--hybrid"))
    fixed = args.chain is not None or not (args.tree or args.shape or blocks)
    specs = [ChainSpec(args.chain if args.chain is not None else 3)] if fixed else []
    if args.tree:
        specs.append(TreeSpec.parse(args.tree))
    given_min_ngrams = parse_ints(args.hybrid_min_ngram) or []
    if any(n < 1 for n in given_min_ngrams):
        raise UsageError(f"--hybrid-min-ngram takes N >= 1, got {args.hybrid_min_ngram}")
    if args.hybrid is not None:
        for n in given_min_ngrams or [1]:
            specs.append(HybridSpec.parse(args.tree, args.hybrid or (lookup_ks or [3])[0], n))
    if args.shape:
        target, drafter, choice, note = choose_for_drafting(
            args.target, lambda t: make_drafter(args, kind, t), args.drafter, args.device, args.dtype,
            parse_ints(args.aux_layers), args.max_new_tokens, temperature=temperatures[0])
    else:
        target, note = load_target_for(args.target, args.device, args.dtype, parse_ints(args.aux_layers))
        drafter, choice = make_drafter(args, kind, target), None
    if blocks:
        for k in dict.fromkeys(parse_ints(args.block) or [None]):
            specs.append(resolve_block_spec(drafter, target, BlockSpec(k)))
    if choice is not None and choice.shape is not None:
        # A chosen hybrid is measured with its bare tree too, so the table shows what lookup's branch adds, and
        # with its siblings at --hybrid-min-ngram's other N (the cost model weighs those on calibration text only).
        chosen = [choice.shape]
        if isinstance(choice.shape, HybridSpec):
            look = choice.shape.lookup
            siblings = [HybridSpec(choice.shape.tree, NgramSpec(look.k, max(look.max_ngram, n), n))
                        for n in given_min_ngrams if n != look.min_ngram]
            chosen = [choice.shape.tree, choice.shape, *siblings]
        specs += [s for s in chosen if s not in specs]
    for spec in specs:  # a shape this drafter cannot draft is refused before the calibration below runs
        SpeculativeDecoder(target, drafter, spec)
    expected = [(choice.acceptance, choice.cost)] if choice is not None and choice.acceptance is not None else []
    if args.expected:
        from draftsmith.stages.shapes import expectation_basis

        for t in dict.fromkeys(temperatures):
            if not any(abs(acc.temperature - t) < 1e-9 for acc, _ in expected):
                expected.append(expectation_basis(target, drafter, args.drafter, specs, args.max_new_tokens, t))
    report = run_bench(target, drafter, [d for d in args.datasets.split(",") if d], specs, temperatures,
                       limit=args.limit, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       prompt_lookup_ks=lookup_ks, progress=args.progress,
                       train_conversations=args.train_conversations, expected=expected)
    report.update({"auto_shape": {**choice.to_dict(), "dtype": note}} if choice else {})
    if expected and not blocks:
        from draftsmith.stages.expectation import chain_expectation
        from draftsmith.stages.shapes import calibration_tokens

        greedy = next((acc for acc, _ in expected if acc.temperature == 0), None)
        card = chain_expectation(greedy, max_new_tokens=calibration_tokens(args.max_new_tokens)) if greedy else None
        report.update({"card_expectation": card} if card else {})  # what export's card can promise (the demo's)
    paths = write_report(report, args.out)
    if args.readme:
        update_readme(args.readme, report, "draftsmith " + shlex.join(argv), args.readme_section)
    print(json.dumps(report) if args.json else format_table(report))
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return 0


def _quiet_libraries() -> None:
    """transformers' own progress bars and notices would break one-line errors and clean JSON output."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def _decode(args) -> int:
    import torch

    from draftsmith.app.kind_args import drafter_kind, drafts_blocks, make_drafter
    from draftsmith.model.target import context_budget
    from draftsmith.stages.block_decode import BlockSpec
    from draftsmith.stages.decode import ChainSpec, HybridSpec, NgramSpec, SamplingParams, SpeculativeDecoder, TreeSpec
    from draftsmith.stages.step_config import choose_for_drafting, load_target_for

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # an argv byte that is not UTF-8 arrives as a lone surrogate
        raise UsageError("--prompt is not valid UTF-8 text (check the shell's or file's encoding)") from None
    spec = TreeSpec.parse(args.tree) if args.tree else ChainSpec(args.chain if args.chain is not None else 3)
    if (args.chain is not None or args.tree or args.shape) and not (args.drafter or args.random_drafter):
        raise UsageError("--chain/--tree/--shape need --drafter PATH or --random-drafter")
    kind = drafter_kind(args)
    if drafts_blocks(args, kind, ("--chain", "--tree", "--hybrid")):
        spec = BlockSpec(args.block)
    if args.prompt_lookup is not None:
        if args.drafter or args.random_drafter:
            raise UsageError("--prompt-lookup drafts without a drafter; drop --drafter/--random-drafter")
        spec = NgramSpec(args.prompt_lookup)
    if args.hybrid is not None:
        spec = HybridSpec.parse(args.tree, args.hybrid or 3, args.hybrid_min_ngram)
    if args.shape:
        target, drafter, choice, note = choose_for_drafting(args.target, lambda t: make_drafter(args, kind, t),
                                                            args.drafter, args.device, args.dtype,
                                                            parse_ints(args.aux_layers), args.max_new_tokens,
                                                            temperature=args.temperature)
    else:
        target, note = load_target_for(args.target, args.device, args.dtype, parse_ints(args.aux_layers))
        drafter = make_drafter(args, kind, target) if kind else None
        choice = None
    if choice is not None:
        spec, drafter = (choice.shape, drafter) if choice.shape is not None else (spec, None)
    tok = target.tokenizer
    if tok is None:
        raise UsageError(f"{args.target}: no tokenizer next to the model")
    prompt_ids = encode_prompt(tok, args.prompt, chat=args.chat)
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    use_spec = drafter is not None or args.prompt_lookup is not None
    decoder = SpeculativeDecoder(target, drafter, spec if use_spec else None)
    budget = context_budget(target, len(prompt_ids), args.max_new_tokens)
    if budget < args.max_new_tokens:
        print(f"draftsmith: note: --max-new-tokens {args.max_new_tokens} clamped to {budget}: that is what the "
              f"prompt's {len(prompt_ids)} tokens leave of the target's context", file=sys.stderr)
    result = decoder.generate(prompt_ids, budget, sampling, eos_token_ids=stop_token_ids(tok),
                              generator=generator)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        report = {"text": text, **result.to_dict(),
                  "mode": "plain" if not use_spec else type(spec).__name__.removesuffix("Spec").lower(),
                  **({"kind": kind} if kind and use_spec else {}),
                  **({"auto_shape": {**choice.to_dict(), "dtype": note}} if choice else {})}
        print(json.dumps(report))
    else:
        print(text)
        print(f"[{len(result.token_ids)} tokens, {result.target_forward_passes} target passes, "
              f"acceptance length {result.acceptance_length:.2f}, {result.tokens_per_second:.1f} tok/s]",
              file=sys.stderr)
    return 0


# --- doctor / serve --------------------------------------------------------------------------------------
def _add_doctor_parsers(sub) -> None:
    from draftsmith.stages.doctor.report import ENGINES

    p = sub.add_parser(
        "doctor", help="check a target/drafter pair against an engine from files on disk, in seconds",
        description="Reads config, tokenizer and safetensors headers only (never weights) and reports every "
                    "mismatch that would fail at load or accept ~nothing. Exit 0: nothing blocks; 1: an error "
                    "finding; 2: unusable arguments.")
    p.add_argument("--target", required=True, help="target model directory, or a hub id ORG/NAME[@REVISION] read from "
                   "the Hugging Face cache (online: its metadata and safetensors headers; never weights); llamacpp: "
                   "the target's .gguf file")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (any layout draftsmith reads) or hub id; "
                   "llamacpp: also a drafter .gguf")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="engine to check against (default vllm)")
    p.add_argument("--engine-version", default=None, metavar="X.Y",
                   help="vLLM version to check against (default: the one installed here, else the latest facts)")
    p.add_argument("--vllm-import", action="store_true",
                   help="ask the installed vLLM's real classes (imports vLLM: 5-15 s) instead of reading its source")
    add_json_arg(p)

    p = sub.add_parser(
        "serve", help="doctor the pair, then launch vllm serve with the EAGLE-3 speculative config",
        description="Runs doctor for vLLM first and refuses on blocking findings (unless --force), then runs "
                    "`vllm serve TARGET --speculative-config {...}` and prints the exact command. Arguments after "
                    "`--` go to vllm serve unchanged.")
    p.add_argument("--target", required=True, help="target model directory or hub id ORG/NAME[@REVISION] (doctor reads "
                   "the cache or the hub's metadata; vllm serve gets the id)")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory or hub id (vLLM-loadable layout)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K", help="draft tokens (default 3)")
    p.add_argument("--port", type=int, default=None, help="vllm serve --port")
    p.add_argument("--engine-version", default=None, metavar="X.Y", help="vLLM version for doctor's facts")
    p.add_argument("--vllm-bin", default=None, metavar="PATH", help="the vllm executable (default: vllm on PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("--force", action="store_true", help="launch even when doctor finds blocking errors")
    p.add_argument("--check", choices=["on", "off", "strict"], default="on",
                   help="once the server answers, send a few prompts and compare its spec-decode counters (/metrics) "
                        "with the drafter card's acceptance: on (default) warns loudly on a collapse, strict stops "
                        "the server and exits 1, off skips it")
    add_vllm_args(p, max_num_seqs=None, kv_cache_gib=None, title="vLLM engine (passed to vllm serve)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_ARGS",
                   help="extra arguments for vllm serve, after --")


def _doctor_or_serve(args) -> int:
    from draftsmith.stages.doctor.report import DoctorUsageError

    try:
        if args.command == "doctor":
            from draftsmith.stages.doctor.diagnosis import diagnose

            report = diagnose(args.target, args.drafter, engine=args.engine, engine_version=args.engine_version,
                              vllm_import=args.vllm_import)
            print(json.dumps(report.to_dict()) if args.json else report.summary())
            return report.exit_code
        from draftsmith.app.serve import serve

        extra = list(args.vllm_args)
        if extra and extra[0] == "--":
            extra = extra[1:]
        if args.vllm_python and args.vllm_bin:
            raise UsageError("give --vllm-python or --vllm-bin, not both")
        return serve(args.target, args.drafter, args.num_speculative_tokens, port=args.port,
                     extra_args=[*_vllm_serve_args(args), *extra], dry_run=args.dry_run, force=args.force,
                     engine_version=args.engine_version, vllm_bin=args.vllm_python or args.vllm_bin,
                     check=args.check)
    except (DoctorUsageError, *USER_ERRORS) as e:
        return fail(e)
    except OSError as e:
        return fail_os(e)


def _vllm_serve_args(args) -> list[str]:
    """The vLLM flag group as `vllm serve` spells it (only the flags given: the rest stay vLLM's defaults)."""
    check_vllm_args(args)
    out: list[str] = []
    for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.kv_cache_gib is not None:
        out += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30)))]
    return out


if __name__ == "__main__":
    sys.exit(main())
