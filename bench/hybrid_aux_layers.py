"""Which layers should an EAGLE-3 drafter tap on a hybrid target: the field's default spread, or attention only?

SpecForge users argue for attention layers only; its configs space them evenly, mostly on delta-net layers. This
fits a tiny hybrid target (attention every fourth layer) to a chat corpus, fits one drafter per choice of aux layers
to the target's own greedy answers, and measures each drafter's acceptance length on held-out prompts with
draftsmith's lossless decoder (chain of 3), over a few seeds.

    .venv/bin/python bench/hybrid_aux_layers.py --arch qwen3_next --layers 12 --seeds 3 --out runs/aux.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import default_aux_layers
from draftsmith.model.target import Target
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder
from draftsmith.testing.models import build_tiny_model, fit_tiny_chat_model, tiny_chat_corpus
from draftsmith.testing.planted import fit_chain_drafter
from draftsmith.testing.tokenizer import make_tokenizer


def _prompt_ids(tok, conversation) -> list[int]:
    text = tok.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(arch: str, layers: int, seed: int, target_steps: int, drafter_steps: int, train_n: int, eval_n: int,
        new_tokens: int) -> dict:
    tok = make_tokenizer("chatml")
    model = build_tiny_model(arch, seed=seed, num_hidden_layers=layers, vocab_size=len(tok),
                             eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id or 0,
                             pad_token_id=tok.pad_token_id or 0)
    fit_tiny_chat_model(model, tok, target_steps, seed=seed)
    target = Target(model, tok)
    plain = SpeculativeDecoder(target)
    stop = [tok.eos_token_id]
    train = [_prompt_ids(tok, c) for c in tiny_chat_corpus(train_n, seed=100 + seed)]
    held_out = [_prompt_ids(tok, c) for c in tiny_chat_corpus(eval_n, seed=900 + seed)]
    seqs = [p + plain.generate(p, new_tokens, eos_token_ids=stop).token_ids for p in train]
    attention = tuple(i for i in range(layers) if i not in target.recurrent_layers)
    choices = {"default (2, N/2, N-3)": default_aux_layers(layers), "attention layers": attention[-3:]}
    dv = vocab_mod.from_target_ids(torch.arange(target.vocab_size), target.vocab_size)
    out = {"arch": arch, "layers": layers, "seed": seed, "recurrent_layers": list(target.recurrent_layers)}
    for name, aux in choices.items():
        target.set_aux_hidden_state_layers(aux)
        drafter, acc = fit_chain_drafter(target, dv, seqs, steps=drafter_steps)
        dec = SpeculativeDecoder(target, drafter, ChainSpec(3))
        taus = [dec.generate(p, new_tokens, eos_token_ids=stop).acceptance_length for p in held_out]
        out[name] = {"aux_layers": list(aux), "train_acc": [round(a, 3) for a in acc],
                     "tau": round(statistics.mean(taus), 3)}
        print(json.dumps({"seed": seed, "choice": name, **out[name]}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_next")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--target-steps", type=int, default=150)
    ap.add_argument("--drafter-steps", type=int, default=150)
    ap.add_argument("--train", type=int, default=96)
    ap.add_argument("--eval", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    runs = [run(args.arch, args.layers, s, args.target_steps, args.drafter_steps, args.train, args.eval,
                args.new_tokens) for s in range(args.seeds)]
    summary = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["bench/hybrid_aux_layers.py",
                                                                        *map(str, vars(args).values())]),
               "seconds": round(time.time() - t0), "runs": runs}
    print(json.dumps(summary))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
