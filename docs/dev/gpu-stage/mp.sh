#!/bin/bash
# How long vLLM's CLI server takes to reach its EngineCore with each start method (2026-12-07):
# `vllm serve` / api_server set VLLM_WORKER_MULTIPROC_METHOD=spawn when unset
# (vllm/entrypoints/serve/utils/api_utils.py), so EngineCore is a fresh interpreter that imports
# torch and vLLM again. Plain vLLM (VLLM_PLUGINS=), the 7B shape, on a staged device (r.sh 4):
#   bash docs/dev/gpu-stage/mp.sh spawn fork
# -> per method: seconds from launch to the API server's first line, to EngineCore's first
#    line, and to /health 200.
set -u
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_PLUGINS=
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for m in "$@"; do
  log=$OUT/mp-$m.log; t0=$(date +%s.%N)
  VLLM_WORKER_MULTIPROC_METHOD=$m python3 -m vllm.entrypoints.openai.api_server --model /tmp/llama7b \
    --tokenizer /tmp/tiny --port 8123 --gpu-memory-utilization 0.5 --max-model-len 4096 > "$log" 2>&1 &
  pid=$!; api=""; eng=""; ok=""
  while kill -0 $pid 2>/dev/null; do
    now=$(date +%s.%N); el=$(awk "BEGIN{printf \"%.1f\", $now - $t0}")
    [ -z "$api" ] && grep -q 'APIServer pid' "$log" && api=$el
    [ -z "$eng" ] && grep -q 'EngineCore pid' "$log" && eng=$el
    curl -sf -o /dev/null localhost:8123/health && { ok=$el; break; }
    [ "${el%.*}" -gt 240 ] && break
    sleep 0.2
  done
  echo "$m: api_first_line ${api:-?} s, enginecore_first_line ${eng:-?} s, health ${ok:-never} s"
  kill -INT $pid 2>/dev/null; sleep 3; pkill -9 -f 'VLLM::|api_server' 2>/dev/null; sleep 2
done
