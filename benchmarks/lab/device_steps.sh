#!/usr/bin/env bash
# Device step runner for a leased GPU machine (the run tool), one call per lease: unpacks prebuilt tilec build
# caches carried in .tilec-cache-carry/*.tar.xz (each an xz tarball of ONE folder holding the cache's hash folders),
# then runs a step file's lines "NAME SECS CMD..." within BUDGET seconds, each command's output in $OUT/NAME.log
# and its last TAILN lines on stdout; a NAME starting "h200:" runs only on an H200.
# Usage (from the repository root): OUT=dir BUDGET=secs TAILN=n bash benchmarks/lab/device_steps.sh STEPFILE
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TILEC_CACHE_DIR=/tmp/tilec-cache
OUT=${OUT:-/tmp/out}; BUDGET=${BUDGET:-560}; TAILN=${TAILN:-25}; mkdir -p "$OUT"
t0=$(date +%s)
for tb in .tilec-cache-carry/*.tar.xz; do
  [[ -e $tb ]] || continue
  d=$(mktemp -d) && tar xJf "$tb" -C "$d" && mkdir -p "$TILEC_CACHE_DIR" &&
    find "$d" -mindepth 1 -maxdepth 1 -type d -exec cp -rn {}/. "$TILEC_CACHE_DIR"/ \; && echo "unpacked $tb"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
GPU=$(head -1 "$OUT/gpu.txt")
while read -r name secs cmd; do
  [[ -z ${name:-} || $name == \#* ]] && continue
  if [[ $name == h200:* ]]; then [[ $GPU == *H200* ]] || { echo "== ${name} skipped (not an H200)"; continue; }; name=${name#h200:}; fi
  left=$(( BUDGET - ($(date +%s) - t0) ))
  (( left < 15 )) && { echo "== $name skipped (budget)"; continue; }
  (( secs > left )) && secs=$left
  s=$(date +%s)
  timeout "$secs" bash -c "$cmd" < /dev/null > "$OUT/$name.log" 2>&1; rc=$?  # (not the step file on stdin)
  echo "== $name rc=$rc $(( $(date +%s) - s ))s (elapsed $(( $(date +%s) - t0 ))s)"
  tail -n "$TAILN" "$OUT/$name.log"
done < "$1"
