"""At which target size an EAGLE-3 drafter pays in llama.cpp on this CPU: the break-even tau per size and k.

An EAGLE-3 round in llama.cpp costs k drafter calls plus one verify pass of k+1 tokens; it pays when its tau
(tokens per round) exceeds that round's time over one plain step. The round's cost does not depend on the
weights' values, so each size is a llama-architecture GGUF of random weights (--quant: Q4_0, or Q4_K as in the
Q4_K_M files most 1B-8B GGUFs ship; a Q8_0 tied embedding and head) in the shapes of SmolLM2-135M, SmolLM2-360M,
Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, with SmolLM2's tokenizer, and a random-weight draftsmith drafter for
it (32,000-token draft vocabulary, the field's default), exported with `export --format gguf`. A random drafter is
rejected every round, so an EAGLE-3 pass there is exactly one full round. Plain and EAGLE-3 at each k decode the
same prompt in turn, --reps times; the cells are medians, with min-max spread.

Run (alone: llama.cpp binds its threads to the cores):
  python bench/llamacpp_sizes.py --out runs/llamacpp-sizes [--quant q4_k] [--sizes smollm2,135m,1b,3b,8b] [--ks 1,2,3]
(smollm2: the embedded default's own Q4_1 GGUF, a check on the random 135m one)
Files are written once into --out and reused.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from draftsmith.app.bench import machine_info, machine_line
from draftsmith.core import vocab as vocab_mod
from draftsmith.integrations.llamacpp import LlamaCppEngine
from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter, _init_weights
from draftsmith.model.sources import smollm2_gguf_path
from draftsmith.stages.export.gguf import copy_field, export_gguf, finish_gguf, read_target_gguf


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int

    @property
    def params(self) -> float:
        hd = self.hidden // self.heads
        attn = self.hidden * hd * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.ffn) + VOCAB * self.hidden


VOCAB = 49152  # SmolLM2's tokenizer, copied from the embedded GGUF
SHAPES = {
    "135m": Shape(576, 30, 1536, 9, 3),
    "360m": Shape(960, 32, 2560, 15, 5),
    "1b": Shape(2048, 16, 8192, 32, 8),
    "3b": Shape(3072, 28, 8192, 24, 8),
    "8b": Shape(4096, 32, 14336, 32, 8),
}
Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # 32 weights: one f16 scale and 16 bytes of nibbles
Q8_0_BYTES = 34  # 32 weights: one f16 scale and 32 int8


def random_q4_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks whose weights have std ~ 1/sqrt(cols) (so activations stay finite)."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (4.6 * np.sqrt(cols)))
    blocks[:, :, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks (256 weights: f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles),
    the format of Q4_K_M files, the quantization most 1B-8B GGUFs ship in. dmin ~ 7.5 d centres the weights."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    d = np.float16(1.0 / (300.0 * np.sqrt(cols)))
    blocks[:, :, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    blocks[:, :, 2:4] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def random_q8_0(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks (the tied embedding and head, kept at 8 bits as in SmolLM2's own GGUF)."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q8_0_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (74.0 * np.sqrt(cols)))
    blocks[:, :, :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_target(shape: Shape, path: Path, quant: str = "q4_0", seed: int = 0) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    rng = np.random.default_rng(seed)
    hd = shape.hidden // shape.heads
    tmp = path.with_name(f".{path.name}.tmp")
    w = GGUFWriter(tmp, "llama")
    w.add_name(f"random llama {path.stem}")
    w.add_context_length(4096)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_vocab_size(VOCAB)
    for field in read_target_gguf("smollm2").tokenizer_fields:
        copy_field(w, field)
    qtype, blocks = {"q4_0": (GGMLQuantizationType.Q4_0, random_q4_0),
                     "q4_k": (GGMLQuantizationType.Q4_K, random_q4_k)}[quant]

    def add(name: str, rows: int, cols: int) -> None:
        if quant == "q4_k" and cols % 256:  # Q4_K's super-blocks need rows of 256s; llama.cpp's quantizer falls back
            w.add_tensor(name, random_q4_0(rows, cols, rng), raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(name, blocks(rows, cols, rng), raw_dtype=qtype)

    # Tied: no output.weight, as in SmolLM2 and Llama-3.2.
    w.add_tensor("token_embd.weight", random_q8_0(VOCAB, shape.hidden, rng), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    for i in range(shape.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(shape.hidden, dtype=np.float32))
        add(b + "attn_q.weight", shape.heads * hd, shape.hidden)
        add(b + "attn_k.weight", shape.kv_heads * hd, shape.hidden)
        add(b + "attn_v.weight", shape.kv_heads * hd, shape.hidden)
        add(b + "attn_output.weight", shape.hidden, shape.heads * hd)
        add(b + "ffn_gate.weight", shape.ffn, shape.hidden)
        add(b + "ffn_up.weight", shape.ffn, shape.hidden)
        add(b + "ffn_down.weight", shape.hidden, shape.ffn)
    finish_gguf(w, tmp, path)


def write_drafter(shape: Shape, target: Path, path: Path, dtype: str = "bf16", draft_vocab: int = 32000) -> None:
    cfg = DrafterConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_attention_heads=shape.heads,
                        num_key_value_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
                        vocab_size=VOCAB, draft_vocab_size=draft_vocab, target_hidden_size=shape.hidden,
                        aux_layer_ids=(2, shape.layers // 2, shape.layers - 3), rope_theta=100000.0)
    d = Eagle3Drafter(cfg, draft_vocab=vocab_mod.identity(VOCAB, draft_vocab))
    _init_weights(d)
    export_gguf(d, path, target=target, dtype=dtype, overwrite=True)


def measure(target: Path, drafter: Path, ks: list[int], reps: int, tokens: int, threads: int) -> dict:
    prompt = [int(i) for i in np.random.default_rng(1).integers(100, VOCAB - 100, size=64)]
    engines = {"plain": LlamaCppEngine(target, "plain", threads=threads)}
    engines.update({f"k={k}": LlamaCppEngine(target, "eagle3", drafter=drafter, k=k, threads=threads) for k in ks})
    for e in engines.values():
        e.complete(prompt[:8], 4)  # first-call costs land on no method
    ms: dict[str, list[float]] = {name: [] for name in engines}
    accepted = {name: 0 for name in engines}
    for _ in range(reps):  # interleaved: the machine's drift hits every method alike
        for name, e in engines.items():
            r = e.complete(prompt, tokens)
            ms[name].append(r.predicted_ms / r.verify_passes)
            accepted[name] += r.draft_n_accepted
    plain = statistics.median(ms["plain"])
    out = {"plain_ms_per_token": round(plain, 2), "plain_spread": [round(min(ms["plain"]), 2),
                                                                   round(max(ms["plain"]), 2)]}
    for k in ks:
        v = ms[f"k={k}"]
        out[f"k={k}"] = {"round_ms": round(statistics.median(v), 2), "spread": [round(min(v), 2), round(max(v), 2)],
                         "break_even_tau": round(statistics.median(v) / plain, 2),
                         "drafts_accepted": accepted[f"k={k}"]}
    return out




def markdown(report: dict, command: str) -> str:
    """The table for docs/llamacpp.md: one row per size, the round's ms and break-even tau at each k."""
    ks = [key for key in next(iter(report["sizes"].values())) if key.startswith("k=")]
    head = ("| target shape | params | GGUF | plain ms/token | "
            + " | ".join(f"EAGLE-3 {k}: round ms, pays above tau" for k in ks) + " |")
    lines = [head, "|" + "---|" * (4 + len(ks))]
    for name, r in report["sizes"].items():
        quant = report.get("quant", "q4_0").upper()
        label = "SmolLM2-135M (its own Q4_1 GGUF)" if name == "smollm2" else f"{name} (random {quant})"
        lo, hi = r["plain_spread"]
        cells = [f"{r[k]['round_ms']:.1f} ({r[k]['spread'][0]:.1f}-{r[k]['spread'][1]:.1f}), "
                 f"**{r[k]['break_even_tau']:.2f}**" for k in ks]
        lines.append(f"| {label} | {r['params']:.2f}B | {r['gguf_gib']:.2f} GiB | {r['plain_ms_per_token']:.1f} "
                     f"({lo:.1f}-{hi:.1f}) | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Drafter weights {report.get('drafter_dtype', 'bf16')}. "
                 f"Measured {report['date']} on {report['machine']}, llama.cpp {report['threads']} thread(s), "
                 f"{report['tokens']} new tokens a request, median of {report['reps']} (min-max): `{command}`")
    return "\n".join(lines)


def write_readme(page: Path, table: str, name: str) -> None:
    """Replace the text between the page's ``llamacpp-sizes-NAME`` markers with ``table``."""
    mark = f"llamacpp-sizes-{name}"
    start, end = f"<!-- {mark}:start -->", f"<!-- {mark}:end -->"
    text = page.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"llamacpp_sizes: error: {page} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    page.write_text(f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="GGUFs and sizes-QUANT.json go here")
    ap.add_argument("--sizes", default="smollm2,135m,360m,1b,3b,8b",
                    help=f"comma-separated: smollm2, {', '.join(SHAPES)}")
    ap.add_argument("--ks", default="1,2,3", help="EAGLE-3 draft lengths")
    ap.add_argument("--quant", choices=("q4_0", "q4_k"), default="q4_0",
                    help="the random targets' weights: Q4_0 (llama.cpp repacks it for its CPU kernels) or Q4_K "
                         "(Q4_K_M files' format)")
    ap.add_argument("--drafter-dtype", choices=("bf16", "q8_0"), default="bf16",
                    help="the drafter GGUF's weights (`export --export-dtype`)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a request")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--readme", default=None,
                    help="write the table into this page's llamacpp-sizes-QUANT-DRAFTERDTYPE markers")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ks = [int(k) for k in args.ks.split(",")]
    report = {"date": time.strftime("%Y-%m-%d"), "quant": args.quant, "drafter_dtype": args.drafter_dtype,
              "machine": machine_line(machine_info()).rsplit(", ", 2)[0], "threads": args.threads,
              "tokens": args.tokens, "reps": args.reps, "sizes": {}}
    for name in args.sizes.split(","):
        shape = SHAPES["135m" if name == "smollm2" else name]
        suffix = "" if args.drafter_dtype == "bf16" else f"-{args.drafter_dtype}"
        target, drafter = out / f"llama-{name}-{args.quant}.gguf", out / f"drafter-{name}{suffix}.gguf"
        if name == "smollm2":  # the embedded default's own Q4_1 GGUF, to check the random ones against
            target = smollm2_gguf_path()
        elif not target.is_file():
            t0 = time.perf_counter()
            write_target(shape, target, args.quant)
            print(f"{name}: wrote {target} ({target.stat().st_size / 2**30:.2f} GiB, "
                  f"{time.perf_counter() - t0:.0f} s)", flush=True)
        if not drafter.is_file():
            drafter.parent.mkdir(parents=True, exist_ok=True)
            write_drafter(shape, target, drafter, args.drafter_dtype)
        row = measure(target, drafter, ks, args.reps, args.tokens, args.threads)
        row.update(params=round(shape.params / 1e9, 3), gguf_gib=round(target.stat().st_size / 2**30, 3))
        report["sizes"][name] = row
        print(f"{name} ({row['params']}B params, {row['gguf_gib']} GiB {args.quant.upper()}): "
              f"plain {row['plain_ms_per_token']} ms; "
              + "; ".join(f"k={k} round {row[f'k={k}']['round_ms']} ms, pays above tau "
                          f"{row[f'k={k}']['break_even_tau']}" for k in ks), flush=True)
        (out / f"sizes-{args.quant}-{args.drafter_dtype}.json").write_text(json.dumps(report, indent=1))
    command = "python bench/llamacpp_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(report, command))
    if args.readme:
        write_readme(Path(args.readme), markdown(report, command), f"{args.quant}-{args.drafter_dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
