#!/bin/bash
# staging call 3: deps, vLLM's Python tree, FA3; tiny model; the project from .gpu/q3/src.tgz
# (a committed tree, unpacked to /tmp/src); the 7B shape; then "$@" run from /tmp/src
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 .gpu/stage/unpack.py .gpu/q3 /tmp/site || exit 2
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
[ -f /tmp/tiny/config.json ] || python3 .gpu/stage/mkmodel.py /tmp/tiny > "$OUT/mkmodel.log" 2>&1 || { cat "$OUT/mkmodel.log"; exit 4; }
python3 -c "import vllm, torch; torch.ops.load_library('/tmp/site/vllm/_C_stable_libtorch.abi3.so'); print('vllm', vllm.__version__, 'ok')" || exit 5
mkdir -p /tmp/stage && cp -r .gpu/stage/* /tmp/stage/
bash .gpu/stage/src.sh .gpu/src.tgz || exit 6
t=$(date +%s); [ -f /tmp/llama7b/config.json ] || python3 /tmp/stage/mk7b.py /tmp/llama7b > "$OUT/mk7b.log" 2>&1 || exit 7
echo "staged; 7B in $(( $(date +%s) - t )) s"
cd /tmp/src
if [ $# -gt 0 ]; then echo "+ $*"; exec "$@"; fi
