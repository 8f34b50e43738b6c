#!/usr/bin/env bash
# Every figure the README still lacks from a GPU, in one run of about 8 minutes on one GPU.
#
#   bash benchmarks/gpu_figures.sh [OUT_DIR]          # default: gpu-figures/
#   DEVICE=cpu BIG=gpt-tiny SECONDS_PER_CELL=1 ROUNDS=2 TRAIN_STEPS=20 \
#       bash benchmarks/gpu_figures.sh /tmp/dry                               # a dry run anywhere
#
# Phases run most-wanted first, each under its own time limit, and write into OUT_DIR as they
# go, so that a run cut short still leaves what it measured. gpudl must be importable
# (`pip install -e . --no-deps` where torch, numpy and rich are present).
set -u
out=${1:-gpu-figures}
device=${DEVICE:-cuda}
cell_s=${SECONDS_PER_CELL:-4}
big=${BIG:-gpt2-124m}       # the GPU-sized model
rounds=${ROUNDS:-10}
train_sets=(--set run.dir="$out/runs")
[ -n "${TRAIN_STEPS:-}" ] && train_sets+=(--set train.max_steps="$TRAIN_STEPS")
mkdir -p "$out"
log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$out/phases.txt"; }
phase() {  # phase NAME SECONDS COMMAND...: run it under a limit, output to OUT_DIR/NAME.txt
    local name=$1 limit=$2; shift 2
    log "start $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    log "end $name: exit $?"
}

phase info 60 python -m gpudl info
python -m gpudl info --json > "$out/info.json" 2>/dev/null
# 1. CPU vs GPU for the default suite, eager (the speed-up column); the CPU cells use this machine's cores.
phase bench-suite 200 python -m gpudl bench --device "$device" --device cpu --no-compile \
    --max-seconds "$cell_s" --out "$out/bench-suite"
# 2. A GPU-sized model on the GPU, every precision, compile off and on.
phase bench-big 200 python -m gpudl bench --device "$device" --model "$big" --batch-size 8 \
    --max-seconds "$cell_s" --out "$out/bench-big"
# 3. Loop overhead and peers at a size where the GPU, not Python, sets the pace.
phase overhead 90 python benchmarks/overhead.py --device "$device" --model "$big" --batch-size 8 --rounds $((2 * rounds))
phase peers 150 python benchmarks/peers.py --device "$device" --model "$big" --batch-size 8 --rounds "$rounds"
# 4. The default training run, end to end.
phase train 120 python -m gpudl train --device "$device" "${train_sets[@]}"
log "done"
