#!/bin/bash
# gated24 with both start levers on a staged device, from the call's checkout copy (installed into /tmp/site):
#   run("bash docs/dev/gpu-stage/gated24.sh NAME [vllm-guard serve flags]")  ->  $OUT/NAME.tar.xz
# SCENARIO=kills24 for the crash run; PROMPTS=N (default 1200) for a longer run, e.g. PROMPTS=3000 with
# `--max-requests 1000` so that every recycle finds its standby parked (it parks 45-70 s after its spawn).
set -u
NAME=$1; shift
# LEVERS=off: vLLM's defaults (no VLLM_USE_MEGA_AOT_ARTIFACT, vLLM's own CUDA-graph sizes).
# BENCH_ARGS: more bench/gpu_serving.py flags, e.g. BENCH_ARGS="--kill-at 90 190" for kills24.
SCENARIO=${SCENARIO:-gated24}; PROMPTS=${PROMPTS:-1200}; LEVERS=${LEVERS:-on}; BENCH_ARGS=${BENCH_ARGS:-}
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . >/dev/null 2>&1 || echo "install failed"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
CG=""
if [ "$LEVERS" = on ]; then
  export VLLM_USE_MEGA_AOT_ARTIFACT=1
  CG='--compilation-config {"cudagraph_capture_sizes":[1,2,4,8,16,24,32,48,64,96,128,192,256,384,512]}'
fi
t=$(date +%s)
python3 bench/gpu_serving.py $SCENARIO --out /tmp/$NAME --model /tmp/llama7b --tokenizer /tmp/tiny --num-prompts $PROMPTS \
  --state-root /tmp/st-$NAME --serve-args "$*" --vllm-args "$CG" $BENCH_ARGS > /tmp/$NAME.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t )) s"; tail -2 /tmp/$NAME.log | cut -c1-900
cp /tmp/st-$NAME/$SCENARIO/logs/generation-*.log /tmp/$NAME/$SCENARIO/ 2>/dev/null
cp /tmp/st-$NAME/$SCENARIO/patches/warm-imports-*.json /tmp/$NAME/$SCENARIO/ 2>/dev/null
for g in /tmp/st-$NAME/$SCENARIO/patches/gen-*/gate/state.json; do echo "$g: $(python3 -c "import json,sys; d=json.load(open('$g')); d.pop('prestage',None); print(d)")" | cut -c1-600; done
# each EngineCore's triton-ptxas state, and which Triton kernels each generation compiled (by mtime)
python3 - /tmp/st-$NAME/$SCENARIO <<'PY' > /tmp/$NAME/$SCENARIO/triton.txt
import json, sys, pathlib
st = pathlib.Path(sys.argv[1])
for f in sorted(st.glob("patches/gen-*/*.json")):
    try:
        d = json.loads(f.read_text())
    except (OSError, ValueError):
        continue
    if d.get("process") in ("engine_core", "worker"):
        print(f.parent.name, d["process"], d["patches"].get("triton-ptxas"))
for f in sorted(st.glob("triton-cache/*/*.json"), key=lambda p: p.stat().st_mtime):
    if not f.name.startswith("__grp__"):
        print(round(f.stat().st_mtime, 1), f.parent.name[:12], f.name)
PY
grep -c . /tmp/$NAME/$SCENARIO/triton.txt; grep -v "^[0-9]" /tmp/$NAME/$SCENARIO/triton.txt; grep "top_k\|topk" /tmp/$NAME/$SCENARIO/triton.txt | head
grep -h "downtime_s" /tmp/$NAME/$SCENARIO/server.log | cut -c1-200
tar cJf $OUT/$NAME.tar.xz -C /tmp $NAME $NAME.log; ls -la $OUT
