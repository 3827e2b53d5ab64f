#!/bin/bash
# Staging in four calls when the checkout is too large for the older q1/q2/q3 split:
# every part (.gpu/p1, .gpu/p2) in one tar, cut into four 30 MiB pieces (.gpu/r1 .. r4; built by
# `bash docs/dev/gpu-stage/r.sh build` here). Three 39 MiB pieces fitted until the tracked tree
# passed 26 MB (2026-12-06: a call carries at most 64 MiB with the tree). On the device, back to back:
#   run("bash docs/dev/gpu-stage/r.sh 1", carry=[".gpu/r1", ".gpu/stage"])
#   run("bash docs/dev/gpu-stage/r.sh 2", carry=[".gpu/r2"])
#   run("bash docs/dev/gpu-stage/r.sh 3", carry=[".gpu/r3"])
#   run("bash docs/dev/gpu-stage/r.sh 4 COMMAND...", carry=[".gpu/r4"])
# Step 4 joins and unpacks into /tmp/site, makes the tiny model and the 7B shape, installs the
# call's checkout copy, then runs COMMAND there (no src.tgz: the checkout travels with every call).
set -u
step=$1; shift
case $step in
build)
  rm -rf .gpu/r1 .gpu/r2 .gpu/r3 .gpu/r4 .gpu/piece.* && mkdir -p .gpu/r1 .gpu/r2 .gpu/r3 .gpu/r4 || exit 1
  tar -cf - -C .gpu p1 p2 | split -b 30M - .gpu/piece. || exit 1
  [ -e .gpu/piece.ae ] && { echo "r.sh build: more than four pieces; raise the size" >&2; exit 1; }
  mv .gpu/piece.aa .gpu/r1/ && mv .gpu/piece.ab .gpu/r2/ && mv .gpu/piece.ac .gpu/r3/ && mv .gpu/piece.ad .gpu/r4/ || exit 1
  ls -la .gpu/r1 .gpu/r2 .gpu/r3 .gpu/r4 ;;
1|2|3)
  mkdir -p /tmp/parts && cp .gpu/r$step/piece.* /tmp/parts/ || exit 2
  [ -d .gpu/stage ] && { mkdir -p /tmp/stage && cp -r .gpu/stage/* /tmp/stage/; }
  ls -la /tmp/parts
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
  echo "r$step done" ;;
4)
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts/x
  t=$(date +%s)
  cat /tmp/parts/piece.aa /tmp/parts/piece.ab /tmp/parts/piece.ac .gpu/r4/piece.ad | tar -xf - -C /tmp/parts/x || exit 3
  python3 /tmp/stage/unpack.py /tmp/parts/x/p1 /tmp/site || exit 3
  python3 /tmp/stage/unpack.py /tmp/parts/x/p2 /tmp/site || exit 3
  rm -rf /tmp/parts
  export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
  [ -f /tmp/tiny/config.json ] || python3 /tmp/stage/mkmodel.py /tmp/tiny > "$OUT/mkmodel.log" 2>&1 || { cat "$OUT/mkmodel.log"; exit 4; }
  python3 -c "import vllm, torch; torch.ops.load_library('/tmp/site/vllm/_C_stable_libtorch.abi3.so'); print('vllm', vllm.__version__, 'ok')" || exit 5
  [ -f /tmp/llama7b/config.json ] || python3 /tmp/stage/mk7b.py /tmp/llama7b > "$OUT/mk7b.log" 2>&1 || exit 7
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . >/dev/null 2>&1 || exit 6
  echo "staged in $(( $(date +%s) - t )) s"
  if [ $# -gt 0 ]; then echo "+ $*"; exec "$@"; fi ;;
*) echo "usage: r.sh build | 1 | 2 | 3 | 4 [COMMAND...]" >&2; exit 2 ;;
esac
