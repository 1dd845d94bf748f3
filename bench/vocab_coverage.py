"""Draft-vocabulary coverage of the target's own greedy choices on held-out samples: the vocabulary counted on
the dataset's tokens (``vocab --from data``) against one counted on the target's choices (``--from target``).

Both vocabularies are counted on the training split of a store (the trainer's held-out split by id hash, at
``--held-out``); coverage is the share of the held-out samples' loss positions whose target greedy choice (the
token a T=0 drafter must propose) lies in the vocabulary, and, for reference, the share of their dataset tokens.

    python bench/vocab_coverage.py --store STORE --target smollm2 --sizes 4096,8192,32000
"""

from __future__ import annotations

import argparse
import json

import torch

from draftsmith.core.vocab import count_tokens, from_counts
from draftsmith.data.store import FeatureStore
from draftsmith.model.target import load_target_heads
from draftsmith.stages.capture.vocab import count_store_target_tokens
from draftsmith.stages.train.data import split_eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--sizes", default="4096,32000", help="draft vocabulary sizes, comma-separated")
    ap.add_argument("--held-out", type=float, default=0.2, help="held-out share of the samples, by id hash")
    args = ap.parse_args()

    store = FeatureStore(args.store)
    heads = load_target_heads(args.target, dtype=torch.float32)
    vocab_size = heads.vocab_size
    train, held = split_eval(store.sample_ids, args.held_out)

    def data_counts(idx: list[int]) -> torch.Tensor:
        out = torch.zeros(vocab_size, dtype=torch.int64)
        for i in idx:
            s = store.get(i)
            out += count_tokens(s["input_ids"], s["loss_mask"], vocab_size)
        return out

    counts = {"data": data_counts(train), "target": count_store_target_tokens(store, heads.lm_head_weight, train)}
    held_target = count_store_target_tokens(store, heads.lm_head_weight, held)
    held_data = data_counts(held)
    agree = _agreement(store, heads.lm_head_weight, held)
    rows = []
    for size in (int(x) for x in args.sizes.split(",")):
        for source, c in counts.items():
            vocab, _ = from_counts(c, size)
            keep = vocab.t2d.bool()

            def share(c: torch.Tensor, keep=keep) -> float:
                return round(float(c[keep].sum() / c.sum()), 4)

            rows.append({"size": size, "counted_on": source, "held_out_target_choice_coverage": share(held_target),
                         "held_out_data_token_coverage": share(held_data)})
    print(json.dumps({"store": args.store, "train_samples": len(train), "held_out_samples": len(held),
                      "held_out_loss_positions": int(held_target.sum()),
                      "target_choice_equals_data_token": agree, "rows": rows}, indent=1))


def _agreement(store: FeatureStore, lm_head: torch.Tensor, idx: list[int]) -> float:
    """Share of held-out loss positions where the dataset's token is the target's greedy choice."""
    from draftsmith.model.ttt import target_argmax

    same = total = 0
    for i in idx:
        s = store.get(i)
        before = s["loss_mask"][1:].nonzero().flatten()
        choice = target_argmax(s["hidden_state"][before], lm_head)
        same += int((choice == s["input_ids"][before + 1]).sum())
        total += before.numel()
    return round(same / max(total, 1), 4)


if __name__ == "__main__":
    main()
