"""Benchmark the data stage: capture throughput and bytes per token, draftsmith store vs SpecForge layout.

    OMP_NUM_THREADS=1 python bench/bench_data.py [--target smollm2] [--out out/bench_data.json]

Runs on the embedded default target (SmolLM2-135M-Instruct; the first load converts its GGUF, ~35 s)
over a few dozen synthetic chat conversations written below, so it finishes in a couple of minutes on a
CPU. Measured, each on the same conversations and the same loaded target:

* ``draftsmith capture`` into a bf16 store and an fp8 store (length-sorted, right-padded batches), and
  bf16 with batch 1 to show what batching buys;
* the SpecForge offline layout as a baseline: batch-1 prefill and one ``torch.save`` file per sample
  holding ``input_ids``, ``loss_mask``, ``hidden_state`` and ``aux_hidden_state`` (the three aux states
  concatenated, ``[1, T, 3H]``) in bf16, as SpecForge's ``prepare_hidden_states`` writes them.

Throughput counts real (unpadded) tokens over wall time including tokenization and writing. Bytes per
token are measured on disk and projected to 4096/7168-wide targets with the closed-form payload sizes.
Not a test: numbers depend on the machine; threads default to 1 for steadier numbers on shared CPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

SYSTEM = "You are a concise, friendly assistant. Answer accurately and explain your reasoning briefly."

# (question, answer, follow-up question, follow-up answer): written for this benchmark.
TOPICS = [
    ("What is speculative decoding?",
     "Speculative decoding speeds up text generation by letting a small draft model propose several tokens "
     "ahead, which the large target model then checks in a single forward pass. Every proposed token that "
     "matches what the target would have produced is accepted for free; at the first mismatch the target's "
     "own token is used instead. Because verification is exact, the output is identical to decoding with the "
     "target alone, only faster when the draft model guesses well.",
     "Why does it help on GPUs in particular?",
     "Decoding one token at a time leaves most of a GPU idle because each step is limited by reading the "
     "weights from memory, not by arithmetic. Verifying five draft tokens costs almost the same memory "
     "traffic as generating one, so accepted drafts turn spare compute into extra tokens per step."),
    ("How do I reverse a list in Python?",
     "There are three common ways. `items.reverse()` reverses the list in place and returns None. "
     "`items[::-1]` returns a new reversed copy and leaves the original untouched. `reversed(items)` returns "
     "an iterator, which is handy in a for loop when you do not need a new list at all. For example:\n\n"
     "```python\nnumbers = [1, 2, 3]\nfor n in reversed(numbers):\n    print(n)\n```",
     "Which one is fastest?",
     "For large lists `items.reverse()` is usually fastest because it swaps elements in place without "
     "allocating. Slicing allocates a full copy, and `reversed()` is lazy, so its cost depends on how much "
     "of the iterator you consume."),
    ("Explain photosynthesis to a ten year old.",
     "Plants are like tiny kitchens powered by sunlight. Their leaves catch light and use its energy to mix "
     "water from the roots with carbon dioxide from the air. The recipe makes sugar, which is the plant's "
     "food, and it gives off oxygen as a leftover. That oxygen is the air we breathe, so every time you see "
     "a green leaf in the sun, it is cooking lunch and helping you breathe at the same time.",
     "Why are leaves green?",
     "Leaves contain chlorophyll, the molecule that catches sunlight. It absorbs red and blue light very well "
     "but reflects green light, so green is the colour that bounces back to our eyes."),
    ("Give me three tips for a job interview.",
     "First, research the company: know what it builds, who its customers are, and one recent piece of news, "
     "so your answers connect to its actual work. Second, prepare short stories about your past projects "
     "using situation, task, action and result, because concrete examples are more convincing than "
     "adjectives. Third, bring two or three thoughtful questions about the team and the role; interviews run "
     "both ways, and good questions show genuine interest.",
     "What should I avoid saying?",
     "Avoid criticising former employers, guessing wildly when you do not know something, and talking about "
     "salary before the interviewer raises it. Saying you would need to look something up is fine."),
    ("What is the difference between TCP and UDP?",
     "TCP is connection oriented: it sets up a session, numbers every byte, retransmits lost packets and "
     "delivers data in order, which makes it reliable but adds latency. UDP just sends independent datagrams "
     "with no handshake, ordering or retransmission, so it is lighter and faster but may lose or reorder "
     "packets. Web pages and file transfers use TCP; live video, games and DNS lookups often prefer UDP.",
     "Is QUIC TCP or UDP?",
     "QUIC runs on top of UDP but rebuilds reliability, ordering and congestion control itself, per stream, "
     "so one lost packet does not stall unrelated streams the way it does with TCP."),
    ("Write a haiku about autumn rain.",
     "Cold rain on maple,\nred leaves slide down the window,\nthe kettle answers.",
     "Now one about winter.",
     "Snow hides the footpath,\nonly the crow's dark wingbeats\nwrite on the white sky."),
    ("How does compound interest work?",
     "Compound interest means you earn interest on your interest. If you invest 1,000 at 5 percent a year, "
     "after the first year you have 1,050. In the second year the 5 percent applies to 1,050, giving 1,102.50, "
     "and so on. The balance grows as principal times (1 + rate) to the power of the number of years, so the "
     "growth speeds up over time. Starting early matters more than the exact rate.",
     "How long does it take to double?",
     "A quick estimate is the rule of 72: divide 72 by the yearly rate in percent. At 5 percent money doubles "
     "in about 14.4 years; the exact answer is ln 2 divided by ln 1.05, roughly 14.2 years."),
    ("Summarise the causes of the First World War.",
     "Historians usually point to four long-term causes: militarism, as the great powers built up armies and "
     "navies; alliances, which tied Europe into two armed blocs; imperial rivalry over colonies and markets; "
     "and nationalism, especially in the Balkans. The immediate trigger was the assassination of Archduke "
     "Franz Ferdinand in Sarajevo in June 1914, after which a chain of ultimatums and mobilisations turned a "
     "regional crisis into a continental war within weeks.",
     "Could it have been avoided?",
     "Many historians think so: the July crisis involved choices by a small number of leaders, and different "
     "decisions in Vienna, Berlin or St Petersburg could have kept the conflict local."),
    ("What does a hash table do?",
     "A hash table stores key and value pairs so that lookups, inserts and deletes take constant time on "
     "average. It runs each key through a hash function to pick a bucket in an array, and stores the pair "
     "there. When two keys land in the same bucket, a collision, the table either chains them in a small "
     "list or probes for another free slot. Python dictionaries and Java HashMaps are hash tables.",
     "What happens when it gets full?",
     "When the load factor passes a threshold the table allocates a larger array, usually about twice the "
     "size, and reinserts every entry. That resize is expensive but rare, so the average cost stays constant."),
    ("Plan a three day trip to Lisbon.",
     "Day one: walk the Alfama district, visit the castle of Sao Jorge for the view, and hear fado in the "
     "evening. Day two: take tram 28 to Belem for the Jeronimos monastery, the tower, and the famous custard "
     "tarts, then watch sunset at the LX Factory. Day three: take the train to Sintra for the Pena palace and "
     "the Moorish castle, and return for dinner in Bairro Alto.",
     "Where should I stay?",
     "Baixa and Chiado are central, flat by Lisbon standards, and close to transport, which makes them the "
     "easiest base for a short visit. Alfama is more atmospheric but hilly and quieter at night."),
    ("Why is the sky blue?",
     "Sunlight contains every colour. As it passes through the atmosphere, it scatters off nitrogen and oxygen "
     "molecules, and shorter wavelengths scatter much more strongly than longer ones, roughly with the inverse "
     "fourth power of the wavelength. Blue light is therefore scattered all over the sky and reaches our eyes "
     "from every direction, while most red and yellow light travels straight through.",
     "Then why are sunsets red?",
     "At sunset light crosses far more atmosphere to reach you, so nearly all the blue is scattered away "
     "before it arrives, leaving the reds and oranges."),
    ("How do I make a simple tomato sauce?",
     "Warm three tablespoons of olive oil in a pan, add two sliced garlic cloves and cook gently until they "
     "just turn golden. Add a can of whole peeled tomatoes, crush them with a spoon, season with salt and a "
     "pinch of chilli, and simmer for about twenty minutes until thick. Finish with torn basil and a little "
     "more olive oil. It works on pasta, pizza, or as a base for braised vegetables.",
     "Can I freeze it?",
     "Yes. Cool it completely, portion it into containers or bags, and it keeps for about three months. "
     "Thaw it in the fridge overnight or warm it gently from frozen with a splash of water."),
]


def conversations() -> list[dict]:
    """36 conversations: single turn, two turns, and single turn with a system prompt."""
    out = []
    for i, (q, a, q2, a2) in enumerate(TOPICS):
        one = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"id": f"single-{i}", "messages": one})
        out.append({"id": f"multi-{i}", "messages": [*one, {"role": "user", "content": q2},
                                                       {"role": "assistant", "content": a2}]})
        out.append({"id": f"system-{i}", "messages": [{"role": "system", "content": SYSTEM}, *one]})
    return out


def specforge_capture(target, tokenizer, convs: list[dict], out_dir: Path, max_length: int) -> dict:
    """Baseline: batch-1 prefill, one torch.save file per sample in SpecForge's offline layout."""
    from draftsmith.data.chat import tokenize_conversation

    out_dir.mkdir(parents=True)
    start = time.perf_counter()
    tokens = 0
    for conv in convs:
        tok = tokenize_conversation(tokenizer, conv["messages"], max_length)
        ids = torch.tensor([tok.input_ids])
        res = target.forward(ids, logits_to_keep=1)
        sample = {
            "input_ids": ids,  # [1, T] int64
            "loss_mask": torch.tensor([tok.loss_mask]),  # [1, T] int64
            "hidden_state": res.hidden_state.to(torch.bfloat16).contiguous(),  # [1, T, H]
            "aux_hidden_state": torch.cat(res.aux_hidden_states, dim=-1).to(torch.bfloat16).contiguous(),  # [1,T,3H]
        }
        torch.save(sample, out_dir / f"data_{conv['id']}.ckpt")
        tokens += ids.shape[1]
    elapsed = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return {"tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed, "bytes": size,
            "bytes_per_token": size / tokens, "files": len(convs)}


def fp8_error(bf16_dir: Path, fp8_dir: Path) -> float:
    """Relative RMS error of the fp8 store's features against the bf16 store's (all samples)."""
    from draftsmith.data.store import FeatureStore

    a, b = FeatureStore(bf16_dir, out_dtype=torch.float32), FeatureStore(fp8_dir, out_dtype=torch.float32)
    num = den = 0.0
    for sid in a.sample_ids:
        x, y = a.get_by_id(sid), b.get_by_id(sid)
        for key in ("aux_hidden_states", "hidden_state"):
            num += float(((x[key] - y[key]) ** 2).sum())
            den += float((x[key] ** 2).sum())
    return math.sqrt(num / den)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1, help="repeat the conversation set (more tokens)")
    ap.add_argument("--out", default="out/bench_data.json")
    ap.add_argument("--keep", default=None, help="keep the stores in this directory (default: a temp dir)")
    args = ap.parse_args()

    from draftsmith.data.store import estimate_bytes_per_token
    from draftsmith.model.target import load_target
    from draftsmith.stages.capture import CaptureConfig, capture

    torch.set_num_threads(args.threads)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-data-"))
    if work.exists() and args.keep:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    convs = [{**c, "id": f"{c['id']}-r{r}"} for r in range(args.repeat) for c in conversations()]
    conv_path = work / "conversations.jsonl"
    conv_path.write_text("".join(json.dumps(c) + "\n" for c in convs))

    t0 = time.perf_counter()
    target = load_target(args.target)
    load_s = time.perf_counter() - t0
    tokenizer = target.tokenizer
    target.forward(torch.tensor([[1, 2, 3, 4]]))  # warm-up

    rows = {}

    def run(name: str, **kw) -> None:
        config = CaptureConfig(conversations=conv_path, out=work / name, max_length=args.max_length,
                               progress=False, **kw)
        rep = capture(target, tokenizer, config)
        rows[name] = {"tokens": rep.tokens, "elapsed_s": rep.elapsed_s, "forward_s": rep.forward_s,
                      "tokens_per_s": rep.tokens_per_s, "bytes": rep.store_bytes,
                      "bytes_per_token": rep.bytes_per_token, "files": len(list((work / name).glob("shard-*"))),
                      "padding_overhead": rep.padded_tokens / rep.tokens - 1,
                      "vocab_coverage": rep.vocab.coverage if rep.vocab else None}
        print(f"  {name}: {rep.tokens} tokens, {rep.tokens_per_s:.0f} tok/s", file=sys.stderr)

    print(f"target {args.target} loaded in {load_s:.1f} s; {len(convs)} conversations, "
          f"{args.threads} thread(s)", file=sys.stderr)
    run("draftsmith-bf16", dtype="bf16", batch_size=args.batch_size, draft_vocab_size=32000)
    run("draftsmith-fp8", dtype="fp8", batch_size=args.batch_size, draft_vocab_size=None)
    run("draftsmith-bf16-batch1", dtype="bf16", batch_size=1, draft_vocab_size=None)
    rows["specforge-torch-save"] = specforge_capture(target, tokenizer, convs, work / "specforge", args.max_length)
    print(f"  specforge-torch-save: {rows['specforge-torch-save']['tokens_per_s']:.0f} tok/s", file=sys.stderr)

    h, n = target.hidden_size, len(target.aux_layers)
    specforge_payload = lambda width: 8 + 8 + (n + 1) * width * 2  # int64 ids + int64 mask + bf16 rows
    projection = {
        str(width): {"draftsmith-bf16": estimate_bytes_per_token(width, n, "bf16"),
                     "draftsmith-fp8": estimate_bytes_per_token(width, n, "fp8"),
                     "specforge-torch-save": specforge_payload(width)}
        for width in (h, 4096, 7168)
    }
    result = {
        "target": args.target, "hidden_size": h, "aux_layers": list(target.aux_layers),
        "conversations": len(convs), "threads": args.threads, "batch_size": args.batch_size,
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "target_load_s": load_s,
        "runs": rows, "fp8_relative_rms_error": fp8_error(work / "draftsmith-bf16", work / "draftsmith-fp8"),
        "payload_bytes_per_token": projection,
    }

    base = rows["specforge-torch-save"]
    print(f"\n{'layout':<24}{'tokens':>8}{'tok/s':>9}{'vs SF':>7}{'B/token':>9}{'vs SF':>7}{'files':>7}")
    for name, r in rows.items():
        print(f"{name:<24}{r['tokens']:>8}{r['tokens_per_s']:>9.0f}{r['tokens_per_s'] / base['tokens_per_s']:>6.2f}x"
              f"{r['bytes_per_token']:>9.0f}{r['bytes_per_token'] / base['bytes_per_token']:>6.2f}x{r['files']:>7}")
    print(f"\nfp8 vs bf16 relative RMS error: {result['fp8_relative_rms_error']:.4f}")
    print("payload bytes/token at other widths (3 aux + final):")
    for width, p in projection.items():
        print(f"  H={width:>5}: " + ", ".join(f"{k} {v:,}" for k, v in p.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
