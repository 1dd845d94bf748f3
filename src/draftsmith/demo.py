"""The main job on the embedded default.

For now: a real chat prompt decoded plainly and speculatively (chain and tree) with an untrained drafter
on SmolLM2-135M-Instruct, showing that the output is token-for-token identical and what the speculative
machinery costs when nothing is accepted. Later stages (generate, capture, train, export, bench) plug in here.
"""

from __future__ import annotations

import sys

import torch

PROMPT = "Explain in two sentences why the sky is blue."


def run_demo(target: str = "smollm2", max_new_tokens: int = 64) -> int:
    from draftsmith.cli import encode_prompt, stop_token_ids
    from draftsmith.decode import ChainSpec, SpeculativeDecoder, TreeSpec
    from draftsmith.drafter import new_drafter
    from draftsmith.target import load_target

    print(f"loading target {target} (first run converts the embedded GGUF once) ...", file=sys.stderr)
    tgt = load_target(target)
    tok = tgt.tokenizer
    ids = encode_prompt(tok, PROMPT, chat=True)
    stops = stop_token_ids(tok)
    drafter = new_drafter(tgt)
    rows = []
    plain = SpeculativeDecoder(tgt).generate(ids, max_new_tokens, eos_token_ids=stops)
    rows.append(("plain", plain))
    for name, spec in (("chain k=3", ChainSpec(3)), ("tree 4,4,16", TreeSpec(4, 4, 16))):
        rows.append((name, SpeculativeDecoder(tgt, drafter, spec).generate(ids, max_new_tokens, eos_token_ids=stops)))
    print(f"\nprompt: {PROMPT}\nanswer: {tok.decode(plain.token_ids, skip_special_tokens=True)}\n")
    print(f"{'mode':<14}{'tokens':>7}{'passes':>8}{'tau':>7}{'tok/s':>8}  identical to plain")
    for name, r in rows:
        same = r.token_ids == plain.token_ids
        print(f"{name:<14}{len(r.token_ids):>7}{r.target_forward_passes:>8}{r.acceptance_length:>7.2f}"
              f"{r.tokens_per_second:>8.1f}  {'yes' if same else 'NO'}")
    print("\n(untrained drafter: acceptance near 1 is expected; train one to get a speedup)")
    return 0 if all(r.token_ids == plain.token_ids for _, r in rows) else 1


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sys.exit(run_demo())
