#!/bin/bash
# gated24 with both start levers on a staged device, from the call's checkout copy (installed into /tmp/site):
#   run("bash docs/dev/gpu-stage/gated24.sh NAME [vllm-guard serve flags]")  ->  $OUT/NAME.tar.xz
set -u
NAME=$1; shift
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . >/dev/null 2>&1 || echo "install failed"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_USE_MEGA_AOT_ARTIFACT=1
CG='--compilation-config {"cudagraph_capture_sizes":[1,2,4,8,16,24,32,48,64,96,128,192,256,384,512]}'
t=$(date +%s)
python3 bench/gpu_serving.py gated24 --out /tmp/$NAME --model /tmp/llama7b --tokenizer /tmp/tiny --num-prompts 1200 \
  --state-root /tmp/st-$NAME --serve-args "$*" --vllm-args "$CG" > /tmp/$NAME.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t )) s"; tail -2 /tmp/$NAME.log | cut -c1-900
cp /tmp/st-$NAME/gated24/logs/generation-*.log /tmp/$NAME/gated24/ 2>/dev/null
cp /tmp/st-$NAME/gated24/patches/warm-imports-*.json /tmp/$NAME/gated24/ 2>/dev/null
for g in /tmp/st-$NAME/gated24/patches/gen-*/gate/state.json; do echo "$g: $(python3 -c "import json,sys; d=json.load(open('$g')); d.pop('prestage',None); print(d)")" | cut -c1-600; done
grep -h "downtime_s" /tmp/$NAME/gated24/server.log | cut -c1-200
tar cJf $OUT/$NAME.tar.xz -C /tmp $NAME $NAME.log; ls -la $OUT
