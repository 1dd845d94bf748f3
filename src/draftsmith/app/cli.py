"""Command line: argument parsing only; each command calls one function of the library."""

from __future__ import annotations

import argparse
import json
import sys

from draftsmith import __version__
from draftsmith.core.errors import DraftsmithError, UsageError, one_line
from draftsmith.data.chat import encode_prompt, stop_token_ids

# Errors that are the user's to fix: one line on stderr, exit code 2. ValueError is there for option values
# that library constructors validate (sampling parameters, draft shapes).
USER_ERRORS = (DraftsmithError, FileNotFoundError, NotADirectoryError, ValueError)


def fail(e: BaseException, code: int = 2, then: str = "") -> int:
    """The one way the CLI reports an error: ``draftsmith: error: <message on one line><then>``."""
    print(f"draftsmith: error: {one_line(e)}{then}", file=sys.stderr)
    return code


# Kept in step with draftsmith.stages.decode.MAX_DRAFT_LENGTH / MAX_TREE_TOKENS (not imported: no torch for --help).
_K_BOUND = ("K is at most 64: acceptance decays geometrically with the draft position, so past a few dozen "
            "nothing is accepted while every drafted token still costs a drafter step")
_TREE_BOUND = ("DEPTH at most 64 (as chain K), TOPK at most the drafter's draft vocabulary, TOTAL (verified "
               "tokens, root incl.) at most 1024: a longer verify pass costs a prefill")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L); default (2, N//2, N-3)")


def _parse_ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Forge EAGLE-3 speculative-decoding drafters for any LLM and prove them before deploying.",
    )
    parser.add_argument("--version", action="version", version=f"draftsmith {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decode", help="decode one prompt, plainly or speculatively, and report acceptance")
    _add_target_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (config.json + model.safetensors)")
    g.add_argument("--random-drafter", action="store_true",
                   help="an untrained drafter (acceptance near 1): measures the speculative overhead")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at least 1 (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    s = p.add_mutually_exclusive_group()
    s.add_argument("--chain", type=int, default=None, metavar="K",
                   help=f"draft a chain of K tokens (default 3). {_K_BOUND}")
    s.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help=f"EAGLE-2 dynamic tree, e.g. 5,8,48. {_TREE_BOUND}")
    s.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help=f"n-gram prompt-lookup drafting of K tokens (no drafter; the free baseline). {_K_BOUND}")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    _add_generate_parser(sub)
    _add_capture_parser(sub)
    _add_vocab_parser(sub)
    _add_export_parsers(sub)
    _add_train_parser(sub)
    _add_doctor_parsers(sub)

    p = sub.add_parser("bench", help="measure a drafter on real prompt sets against plain decoding")
    _add_target_args(p)
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory")
    p.add_argument("--datasets", default="mt-bench", help="comma-separated: mt-bench, humaneval, or JSONL paths")
    p.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,1")
    p.add_argument("--chain", type=int, default=None, metavar="K",
                   help=f"chain of K draft tokens (default 3 when --tree is not given). {_K_BOUND}")
    p.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help=f"EAGLE-2 dynamic tree; with --chain too, both are measured in the same run. {_TREE_BOUND}")
    p.add_argument("--prompt-lookup", type=int, default=3, metavar="K",
                   help="also measure n-gram prompt lookup with K tokens (0: skip; at most 64)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (N >= 1)")
    p.add_argument("--turns", type=int, default=None, help="at most N turns per prompt (MT-bench has 2; N >= 1)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at least 1 (default 128)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json, bench.txt, bench.png")
    p.add_argument("--readme", default=None, help="also write the table into this README's bench section")
    p.add_argument("--no-progress", dest="progress", action="store_false")

    p = sub.add_parser("demo", help="the main job: forge and measure a drafter for the embedded default",
                       description="Generate, capture, train, export and bench in one go; rerunning resumes.")
    p.add_argument("--preset", default="default", choices=["tiny", "default", "full"],
                   help="default: ~20 min on 2 CPU cores; full: longer, best numbers; tiny: seconds (tests)")
    p.add_argument("--workdir", default="runs/demo", help="where every artefact goes (default runs/demo)")
    p.add_argument("--target", default=None, help="override the preset's target (a model dir or 'smollm2')")
    p.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="generate with vLLM's engine run by this Python (e.g. .venv-vllm/bin/python; `make demo` "
                        "passes it); default: the in-process backend, several times slower")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("doctor", "serve"):  # before the library imports below: doctor answers in under a second
        return _doctor_or_serve(args)
    _quiet_libraries()
    try:
        if args.command == "decode":
            return _decode(args)
        if args.command in ("generate", "capture", "vocab"):
            return {"generate": _generate, "capture": _capture, "vocab": _vocab}[args.command](args)
        if args.command in ("export", "import"):
            return {"export": _export, "import": _import}[args.command](args)
        if args.command == "train":
            return _train(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "demo":
            from draftsmith.app.demo import run_demo

            run_demo(args.preset, args.workdir, target=args.target, progress=args.progress,
                     vllm_python=args.vllm_python)
            return 0
    except USER_ERRORS as e:
        return fail(e)
    except Exception as e:  # a corrupt weights file that no loader below named: still one line
        from safetensors import SafetensorError

        if not isinstance(e, SafetensorError):
            raise
        return fail(RuntimeError(f"not a valid safetensors file (truncated or corrupt): {one_line(e)}"))
    parser.error(f"unknown command {args.command}")
    return 2


def _bench(args) -> int:
    import torch

    from draftsmith.app.bench import check_bench_args, format_table, run_bench, update_readme, write_report
    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import ChainSpec, TreeSpec

    try:
        temperatures = [float(t) for t in args.temperature.split(",")]
    except ValueError as e:
        raise UsageError(f"--temperature wants comma-separated numbers, got {args.temperature!r}") from e
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--limit", args.limit), ("--turns", args.turns)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.prompt_lookup < 0:
        raise UsageError(f"--prompt-lookup must be >= 0 (0 skips it), got {args.prompt_lookup}")
    check_bench_args([d for d in args.datasets.split(",") if d], temperatures, limit=args.limit, turns=args.turns,
                     max_new_tokens=args.max_new_tokens, prompt_lookup_k=args.prompt_lookup or None)
    specs = [ChainSpec(args.chain if args.chain is not None else 3)] if args.chain is not None or not args.tree else []
    if args.tree:
        specs.append(TreeSpec.parse(args.tree))
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target = load_target(args.target, device=args.device, dtype=dtype, aux_layers=_parse_ints(args.aux_layers))
    drafter = load_drafter(args.drafter, target)
    report = run_bench(target, drafter, [d for d in args.datasets.split(",") if d], specs, temperatures,
                       limit=args.limit, turns=args.turns, max_new_tokens=args.max_new_tokens,
                       prompt_lookup_k=args.prompt_lookup or None, progress=args.progress)
    paths = write_report(report, args.out)
    if args.readme:
        update_readme(args.readme, report, "draftsmith " + " ".join(sys.argv[1:]))
    print(format_table(report))
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

    from draftsmith.model.drafter import load_drafter, new_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import ChainSpec, NgramSpec, SamplingParams, SpeculativeDecoder, TreeSpec

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    spec = TreeSpec.parse(args.tree) if args.tree else ChainSpec(args.chain if args.chain is not None else 3)
    if (args.chain is not None or args.tree) and not (args.drafter or args.random_drafter):
        raise UsageError("--chain/--tree need --drafter PATH or --random-drafter")
    if args.prompt_lookup is not None:
        if args.drafter or args.random_drafter:
            raise UsageError("--prompt-lookup drafts without a drafter; drop --drafter/--random-drafter")
        spec = NgramSpec(args.prompt_lookup)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target = load_target(args.target, device=args.device, dtype=dtype, aux_layers=_parse_ints(args.aux_layers))
    drafter = None
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    elif args.random_drafter:
        drafter = new_drafter(target)
    tok = target.tokenizer
    if tok is None:
        raise UsageError(f"{args.target}: no tokenizer next to the model")
    prompt_ids = encode_prompt(tok, args.prompt, chat=args.chat)
    generator = torch.Generator(device=target.device).manual_seed(args.seed)
    use_spec = drafter is not None or args.prompt_lookup is not None
    decoder = SpeculativeDecoder(target, drafter, spec if use_spec else None)
    result = decoder.generate(prompt_ids, args.max_new_tokens, sampling, eos_token_ids=stop_token_ids(tok),
                              generator=generator)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        report = {"text": text, **result.to_dict(),
                  "mode": "plain" if not use_spec else type(spec).__name__.removesuffix("Spec").lower()}
        print(json.dumps(report))
    else:
        print(text)
        print(f"[{len(result.token_ids)} tokens, {result.target_forward_passes} target passes, "
              f"acceptance length {result.acceptance_length:.2f}, {result.tokens_per_second:.1f} tok/s]",
              file=sys.stderr)
    return 0


# --- generate ------------------------------------------------------------------------------------------
def _add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="regenerate conversations with the target (or self-prompt them)",
        description="Answer prompts (JSONL: ShareGPT, OpenAI messages or {'prompt': ...}) with the target, "
                    "or let it write its own questions (--self-prompt N). Resumable: rerun the same command.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", default=None, metavar="JSONL", help="prompts/conversations (.jsonl or .jsonl.gz)")
    src.add_argument("--self-prompt", type=int, default=None, metavar="N",
                     help="the target writes N user questions itself from its chat template's user header")
    p.add_argument("--out", required=True, metavar="JSONL", help="conversations out (appended; resumed)")
    p.add_argument("--backend", choices=["local", "vllm", "openai"], default="local",
                   help="local: the target in-process (default); vllm: vLLM's offline engine (--vllm-python); "
                        "openai: an OpenAI-compatible server")
    g = p.add_argument_group("local and vllm backends")
    g.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--batch-size", type=int, default=None,
                   help="conversations per round (default: local 8, vllm 256: vLLM schedules a round itself)")
    g = p.add_argument_group("vllm backend (vLLM's offline engine in a child process)")
    g.add_argument("--vllm-python", default=None, metavar="PYTHON",
                   help="a Python with vLLM installed, e.g. .venv-vllm/bin/python (`make vllm-env`)")
    g.add_argument("--vllm-max-num-seqs", type=int, default=128, help="sequences in flight (default 128)")
    g.add_argument("--vllm-kv-cache-gib", type=float, default=2.0, help="KV cache size in GiB (default 2)")
    g = p.add_argument_group("openai backend (vLLM, SGLang, ...)")
    g.add_argument("--server-url", action="append", default=[], metavar="URL",
                   help="e.g. http://localhost:8000 (repeat for several servers: requests go round-robin)")
    g.add_argument("--served-model-name", default=None, help="model name to request (default: first of /v1/models)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's tokenizer; needed for --self-prompt and --max-input-length")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--concurrency", type=int, default=16, help="conversations in flight (default 16)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    g.add_argument("--retries", type=int, default=5,
                   help="retries on connection errors, 429 and 5xx, with exponential backoff (default 5)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn (default 512)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="sampling and self-prompting seed (default 0)")
    g.add_argument("--system", default=None, help="system prompt for conversations that have none")
    g.add_argument("--max-input-length", type=int, default=None, metavar="TOKENS",
                   help="prompts longer than this are errors (later turns: the conversation ends there)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _generate(args) -> int:
    from draftsmith.stages.generate.config import GenerateConfig
    from draftsmith.stages.generate.run import generate

    config = GenerateConfig(
        out=args.out, input=args.input, self_prompt=args.self_prompt, backend=args.backend,
        target=args.target, device=args.device, dtype=args.dtype,
        batch_size=args.batch_size, vllm_python=args.vllm_python,
        vllm_max_num_seqs=args.vllm_max_num_seqs, vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        server_urls=args.server_url, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
        api_key=args.api_key, concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        system=args.system, max_input_length=args.max_input_length, progress=not args.no_progress,
    )
    summary = generate(config)
    print(summary)
    if summary.errors_file is not None:
        print(f"draftsmith: {summary.error} error(s) listed in {summary.errors_file}; rerun the same command "
              "to retry them", file=sys.stderr)
    return 1 if summary.error and not summary.done else 0


# --- capture ---------------------------------------------------------------------------------------------
def _add_capture_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture the target's aux hidden states into a feature store",
                       description="Conversations (JSONL) in, EAGLE-3 training features out: aux hidden states, "
                                   "the final post-norm hidden state, input ids and the assistant loss mask. "
                                   "Resumable: rerun the same command after a crash. Builds the draft "
                                   "vocabulary into the store afterwards.")
    p.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    p.add_argument("--conversations", required=True, metavar="FILE.jsonl",
                   help="one conversation per line: 'messages' (OpenAI) or 'conversations' (ShareGPT), with 'id'")
    p.add_argument("--out", required=True, metavar="STORE_DIR", help="feature store directory (created or resumed)")
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16",
                   help="storage dtype of the features (fp8: per-row scaled e4m3, half the bytes; default bf16)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (default 2048)")
    p.add_argument("--long", choices=["truncate", "skip"], default="truncate",
                   help="conversations over --max-length: cut them or skip them (counted; default truncate)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per forward pass (default 8)")
    p.add_argument("--max-tokens-per-batch", type=int, default=16384,
                   help="padded tokens per forward pass (default 16384)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype of the target (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L); default (2, N//2, N-3)")
    p.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="draft vocabulary built after capture (default 32000; 0 skips the step)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="read only the first N records")
    p.add_argument("--shard-mb", type=float, default=256.0, help="shard size in MiB (default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown on a terminal)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _capture(args) -> int:
    from draftsmith.data.store import StoreError, StoreMismatch, StoreWriteError
    from draftsmith.stages.capture import CaptureConfig, run_capture

    aux = _parse_ints(args.aux_layers)
    if args.shard_mb <= 0:
        raise UsageError("--shard-mb must be positive")
    config = CaptureConfig(
        conversations=args.conversations, out=args.out, target=args.target, device=args.device,
        target_dtype=args.target_dtype, aux_layers=tuple(aux) if aux is not None else None, dtype=args.dtype,
        max_length=args.max_length, long=args.long, batch_size=args.batch_size,
        max_tokens_per_batch=args.max_tokens_per_batch, draft_vocab_size=args.draft_vocab_size or None,
        limit=args.limit, shard_max_bytes=max(1, int(args.shard_mb * 2**20)),
        progress=False if args.no_progress else None,
    )
    try:
        report = run_capture(config)
    except StoreMismatch as e:
        raise UsageError(str(e)) from e
    except (StoreError, OSError) as e:
        # Only a failed write (disk full, I/O error) is fixed by rerunning: the store keeps its last committed
        # shard. A lock another process holds, a corrupt store or a missing file is the user's to fix first.
        if isinstance(e, (FileNotFoundError, NotADirectoryError, PermissionError)):
            raise
        if isinstance(e, StoreError) and not (isinstance(e, StoreWriteError) or e.resumable):
            return fail(e, 1)
        return fail(e, 1, "; committed samples are kept, rerun to resume")
    except KeyboardInterrupt:
        print("draftsmith: interrupted; committed samples are kept, rerun to resume", file=sys.stderr)
        return 130
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


# --- vocab -----------------------------------------------------------------------------------------------
def _add_vocab_parser(sub) -> None:
    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from a feature store",
                       description="Count the target tokens at loss positions of a feature store, keep the most "
                                   "frequent ones and write d2t/t2d/counts (safetensors) with their coverage.")
    p.add_argument("--store", required=True, metavar="STORE_DIR", help="feature store written by capture")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="tokens to keep (default 32000)")
    p.add_argument("--out", default=None, metavar="FILE", help="default STORE_DIR/vocab.safetensors")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _vocab(args) -> int:
    from dataclasses import asdict

    from draftsmith.data.store import StoreError
    from draftsmith.stages.capture import build_vocab

    try:
        report = build_vocab(args.store, args.draft_vocab_size, out=args.out)
    except StoreError as e:
        raise UsageError(one_line(e)) from e
    except OSError as e:
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise
        return fail(e, 1)
    print(json.dumps({**asdict(report), "path": str(report.path)}) if args.json else report.summary())
    return 0


# --- train -----------------------------------------------------------------------------------------------
def _add_train_parser(sub) -> None:
    from draftsmith.stages.train.config import TrainConfig

    p = sub.add_parser("train", help="train an EAGLE-3 drafter with training-time test (offline or online)",
                       description="Every field of the config file can be overridden here (--ttt-steps 3 ...).")
    p.add_argument("--config", default=None, help="TOML or YAML file with the fields below")
    for name, f in TrainConfig.fields().items():
        flag = "--" + name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, dest=name, type=kind, default=None, help=f"(default {f.default!r})")


def _train(args) -> int:
    from draftsmith.stages.train.config import TrainConfig, load_config
    from draftsmith.stages.train.run import train

    overrides = {k: getattr(args, k) for k in TrainConfig.fields() if getattr(args, k, None) is not None}
    cfg = load_config(args.config, overrides)
    result = train(cfg)
    print(json.dumps({"out": str(result.out), "steps": result.steps,
                      "best_simulated_acceptance_length": result.best_simulated_acceptance_length,
                      "last_eval": result.last_eval}))
    return 0


# --- export / import -------------------------------------------------------------------------------------
def _add_export_parsers(sub) -> None:
    p = sub.add_parser("export", help="write a drafter in an engine's layout (SGLang, vLLM, speculators)",
                       description="Write a drafter (draftsmith's own layout, or any layout import reads) as the "
                                   "engine's loader expects it: weight names, aux layer id convention, config "
                                   "fields. Writes config.json, model.safetensors and draftsmith-export.json.")
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter directory")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "speculators"],
                   help="sglang: EAGLE-3 HF layout (midlayer.*, eagle_config ids one lower; vLLM reads it too); "
                        "vllm: --speculative-config model dir; speculators: `vllm serve DIR` works")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also write embed_tokens.weight (engines share the target's otherwise); needs --target "
                        "unless the drafter has its own")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="the target model: source of --include-embeddings, default of --verifier")
    p.add_argument("--verifier", default=None, metavar="NAME_OR_PATH",
                   help="speculators: the target vLLM serves (Hugging Face id or directory); default --target")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K",
                   help="speculators: draft tokens per step written into the config (default 3)")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    p = sub.add_parser("import", help="read a drafter from EAGLE, SpecForge, SGLang, vLLM or speculators",
                       description="Convert an EAGLE-3 checkpoint into draftsmith's layout, translating weight "
                                   "names and aux layer ids (to input-of-layer ids). Missing d2t/t2d: identity.")
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    p.add_argument("--format", default="auto", choices=["auto", "eagle", "sglang", "vllm", "speculators", "draftsmith"],
                   help="source layout (default auto: detected from config and weight names)")
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L) when the checkpoint has none or is wrong")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _export(args) -> int:
    import warnings

    from draftsmith.stages.export import export_drafter, target_embeddings

    if args.num_speculative_tokens < 1:
        raise UsageError("--num-speculative-tokens must be >= 1")
    embeddings = target_embeddings(args.target) if args.include_embeddings and args.target else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_drafter(
            args.drafter, args.out, args.format, dtype=args.dtype, include_embeddings=args.include_embeddings,
            embeddings=embeddings, verifier=args.verifier or args.target,
            num_speculative_tokens=args.num_speculative_tokens, overwrite=args.force)
    for w in caught:
        print(f"draftsmith: warning: {w.message}", file=sys.stderr)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


def _import(args) -> int:
    import warnings

    from draftsmith.stages.export import import_drafter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = import_drafter(args.source, args.out, args.format, aux_layers=_parse_ints(args.aux_layers),
                                overwrite=args.force)
    for w in caught:
        print(f"draftsmith: warning: {w.message}", file=sys.stderr)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


# --- doctor / serve --------------------------------------------------------------------------------------
def _add_doctor_parsers(sub) -> None:
    from draftsmith.stages.doctor.report import ENGINES

    p = sub.add_parser(
        "doctor", help="check a target/drafter pair against an engine from files on disk, in seconds",
        description="Reads config, tokenizer and safetensors headers only (never weights) and reports every "
                    "mismatch that would fail at load or accept ~nothing. Exit 0: nothing blocks; 1: an error "
                    "finding; 2: unusable arguments.")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter directory (any layout draftsmith reads)")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="engine to check against (default vllm)")
    p.add_argument("--engine-version", default=None, metavar="X.Y",
                   help="vLLM version to check against (default: the one installed here, else the latest facts)")
    p.add_argument("--vllm-import", action="store_true",
                   help="ask the installed vLLM's real classes (imports vLLM: 5-15 s) instead of reading its source")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    p = sub.add_parser(
        "serve", help="doctor the pair, then launch vllm serve with the EAGLE-3 speculative config",
        description="Runs doctor for vLLM first and refuses on blocking findings (unless --force), then runs "
                    "`vllm serve TARGET --speculative-config {...}` and prints the exact command. Arguments after "
                    "`--` go to vllm serve unchanged.")
    p.add_argument("--target", required=True, help="target model directory (or a name vLLM resolves)")
    p.add_argument("--drafter", required=True, help="EAGLE-3 drafter directory (vLLM-loadable layout)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K", help="draft tokens (default 3)")
    p.add_argument("--port", type=int, default=None, help="vllm serve --port")
    p.add_argument("--engine-version", default=None, metavar="X.Y", help="vLLM version for doctor's facts")
    p.add_argument("--vllm-bin", default=None, metavar="PATH", help="the vllm executable (default: vllm on PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("--force", action="store_true", help="launch even when doctor finds blocking errors")
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
        return serve(args.target, args.drafter, args.num_speculative_tokens, port=args.port, extra_args=extra,
                     dry_run=args.dry_run, force=args.force, engine_version=args.engine_version,
                     vllm_bin=args.vllm_bin)
    except (DoctorUsageError, *USER_ERRORS) as e:
        return fail(e)


if __name__ == "__main__":
    sys.exit(main())
