"""Command line: argument parsing only; each command calls one function of the library."""

from __future__ import annotations

import argparse
import json
import sys

from draftsmith import __version__


class UsageError(Exception):
    """Unusable arguments or inputs: reported in one line, exit code 2."""


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
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    s = p.add_mutually_exclusive_group()
    s.add_argument("--chain", type=int, default=None, metavar="K", help="draft a chain of K tokens (default 3)")
    s.add_argument("--tree", default=None, metavar="DEPTH,TOPK,TOTAL",
                   help="EAGLE-2 dynamic tree, e.g. 5,8,48")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    _add_generate_parser(sub)
    _add_capture_parser(sub)
    _add_vocab_parser(sub)

    p = sub.add_parser("demo", help="the main job on the embedded default (grows into the whole pipeline)")
    p.add_argument("--target", default="smollm2", help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "decode":
            return _decode(args)
        if args.command in ("generate", "capture", "vocab"):
            return {"generate": _generate, "capture": _capture, "vocab": _vocab}[args.command](args)
        if args.command == "demo":
            from draftsmith.demo import run_demo

            return run_demo(target=args.target, max_new_tokens=args.max_new_tokens)
    except UsageError as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # TargetError, DrafterError, VocabError and bad option values
        print(f"draftsmith: error: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


def _decode(args) -> int:
    import torch

    from draftsmith.decode import ChainSpec, SamplingParams, SpeculativeDecoder, TreeSpec
    from draftsmith.drafter import load_drafter, new_drafter
    from draftsmith.target import load_target

    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    spec = TreeSpec.parse(args.tree) if args.tree else ChainSpec(args.chain or 3)
    if (args.chain or args.tree) and not (args.drafter or args.random_drafter):
        raise UsageError("--chain/--tree need --drafter PATH or --random-drafter")
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
    decoder = SpeculativeDecoder(target, drafter, spec if drafter is not None else None)
    result = decoder.generate(prompt_ids, args.max_new_tokens, sampling, eos_token_ids=stop_token_ids(tok),
                              generator=generator)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        report = {"text": text, **result.to_dict(),
                  "mode": "plain" if drafter is None else ("tree" if isinstance(spec, TreeSpec) else "chain")}
        print(json.dumps(report))
    else:
        print(text)
        print(f"[{len(result.token_ids)} tokens, {result.target_forward_passes} target passes, "
              f"acceptance length {result.acceptance_length:.2f}, {result.tokens_per_second:.1f} tok/s]",
              file=sys.stderr)
    return 0


# --- generate ------------------------------------------------------------------------------------------
def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="regenerate conversations with the target (or self-prompt them)")
    p.set_defaults(_unimplemented=True)


def _generate(args) -> int:
    raise UsageError("generate is not implemented yet")


# --- capture ---------------------------------------------------------------------------------------------
def _add_capture_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture the target's aux hidden states into a feature store")
    p.set_defaults(_unimplemented=True)


def _capture(args) -> int:
    raise UsageError("capture is not implemented yet")


# --- vocab -----------------------------------------------------------------------------------------------
def _add_vocab_parser(sub) -> None:
    p = sub.add_parser("vocab", help="build the draft vocabulary (d2t/t2d) from a feature store")
    p.set_defaults(_unimplemented=True)


def _vocab(args) -> int:
    raise UsageError("vocab is not implemented yet")


# --- shared helpers ---------------------------------------------------------------------------------------
def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError(f"--chat: tokenizer {tokenizer.name_or_path!r} has no chat template")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def stop_token_ids(tokenizer) -> list[int]:
    """eos plus the chat template's end-of-turn tokens that exist in the vocabulary."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for t in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<end_of_turn>"):
        if t in vocab:
            ids.add(int(vocab[t]))
    return sorted(ids)


if __name__ == "__main__":
    sys.exit(main())
