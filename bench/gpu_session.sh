#!/usr/bin/env bash
# One device call that runs the GPU checks and benchmarks and packs every result into
# $OUT/results.tar.gz (the device returns at most 8 files). Run through the shared recipe:
#   bash .gpu/stage/call2.sh bash bench/gpu_session.sh [runtime|budgets|runtime2|benches|soakbench]
set -u
OUT=${OUT:-/tmp/out}
R=/tmp/results; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
export VLLM_GUARD_TINY_MODEL=/tmp/tiny VLLM_GUARD_REQUIRE_GPU=1 VLLM_GUARD_RESULTS=$R
what=${1:-runtime}
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; nproc; } > "$R/env.txt" 2>&1
GPU_ARGS="--enforce-eager --max-model-len 1024 --gpu-memory-utilization 0.15"
if [ "$what" = runtime ]; then
  python3 -m vllm_guard.cli patches list --json > "$R/patches_list_0.25.1.json" 2> "$R/patches_list.err"
  [ -f bench/gpu_nvml_record.py ] && (python3 bench/gpu_nvml_record.py --out "$R/nvml_h200.jsonl" > "$R/nvml_record.log" 2>&1 &)
  (python3 bench/bench_recycle.py --recycles 2 --concurrency 8 --out "$R/bench_recycle_gpu.json" -- $GPU_ARGS > "$R/bench_recycle.log" 2>&1; echo "rc $?" >> "$R/bench_recycle.log") &
  python3 -m pytest tests/gpu -x -v -p no:cacheprovider -k "runtime or nvml" > "$R/gpu_tests.log" 2>&1; echo "pytest rc $?" >> "$R/gpu_tests.log"
  wait
  python3 bench/bench_proxy.py guard --rounds 6 --requests 320 --concurrency 16 --max-tokens 32 \
    --out "$R/bench_proxy_gpu.json" -- $GPU_ARGS > "$R/bench_proxy.log" 2>&1
  # wait for the background NVML recorder (it stops by itself)
  for i in $(seq 1 60); do pgrep -f gpu_nvml_record >/dev/null || break; sleep 2; done
fi
if [ "$what" = budgets ]; then
  python3 bench/gpu_budgets.py --out "$R/budgets" --duration ${DURATION:-200} --deadline ${DEADLINE:-450} > "$R/gpu_budgets.log" 2>&1
  echo "budgets rc $?" >> "$R/gpu_budgets.log"
  for p in rtx4090-24g a100-80g; do
    python3 -c "import sqlite3,sys; s=sqlite3.connect(sys.argv[1]); d=sqlite3.connect(sys.argv[2]); s.backup(d)" \
      "$R/budgets/$p/state/ledger.sqlite" "$R/$p.sqlite"
  done
  python3 -m vllm_guard.cli report --compare "$R/rtx4090-24g.sqlite" "$R/a100-80g.sqlite" --format html --out "$R/compare.html" >> "$R/gpu_budgets.log" 2>&1
  python3 -m vllm_guard.cli report --compare "$R/rtx4090-24g.sqlite" "$R/a100-80g.sqlite" --format json --out "$R/compare.json" >> "$R/gpu_budgets.log" 2>&1
  tail -n 200 "$R/budgets/plain-24g/vllm.log" > "$R/plain_vllm_tail.log" 2>/dev/null
fi
if [ "$what" = runtime2 ]; then
  # the runtime GPU test with torch.compile on: generation 1 compiles into an empty cache in the
  # state dir, the recycled generations start with it warm (cold_start_s per generation)
  python3 -m pytest tests/gpu/test_runtime_gpu.py -x -v -p no:cacheprovider > "$R/gpu_tests.log" 2>&1
  echo "pytest rc $?" >> "$R/gpu_tests.log"
  python3 bench/bench_proxy.py synthetic --rounds 10 --requests 1000 --concurrency 16 --max-tokens 16 \
    --out "$R/bench_proxy_synthetic_16c.json" > "$R/bench_proxy_synth.log" 2>&1
fi
if [ "$what" = benches ]; then
  # GPU runs in the background, the soak-client benches in the foreground; every step is bounded
  # so the call ends inside its 600 s (what overlapped with what is in benches.log)
  (timeout 470 python3 bench/bench_recycle.py --model /tmp/tiny --recycles 2 --concurrency 8 --out "$R/bench_recycle_compile.json" \
     -- --max-model-len 1024 --gpu-memory-utilization 0.1 > "$R/bench_recycle_compile.log" 2>&1; echo "recycle rc $?" >> "$R/benches.log") &
  (timeout 420 python3 bench/bench_patches_gpu.py --model /tmp/tiny --out "$R/patches_gpu.json" > "$R/patches_gpu.log" 2>&1; \
     echo "patches_gpu rc $?" >> "$R/benches.log") &
  date -u +"soak_rate start %T" >> "$R/benches.log"
  timeout 150 python3 bench/bench_soak_rate.py --rates 200,400,800,1200,1600,2400,3200 --seconds 8 \
    --json "$R/soak_rate.json" > "$R/soak_rate.log" 2>&1; echo "soak_rate rc $?" >> "$R/benches.log"
  date -u +"soak_vs_vllm start %T" >> "$R/benches.log"
  timeout 330 python3 bench/bench_soak_vs_vllm.py --pairs 6 --num 200 --rate 20 --tokenizer /tmp/tiny \
    --vllm-args "--enforce-eager --max-model-len 512 --gpu-memory-utilization 0.1" \
    --json "$R/soak_vs_vllm.json" > "$R/soak_vs_vllm.log" 2>&1; echo "soak_vs_vllm rc $?" >> "$R/benches.log"
  wait
  date -u +"end %T" >> "$R/benches.log"
  cat "$R/benches.log"
fi
if [ "$what" = soakbench ]; then
  # alone on the box: vllm bench serve, the soak (token ids) and the soak (text prompts), rotated
  timeout ${SOAKBENCH_S:-470} python3 bench/bench_soak_vs_vllm.py --pairs 6 --num 200 --rate 20 --soak-text --tokenizer /tmp/tiny \
    --vllm-args "--enforce-eager --max-model-len 512 --gpu-memory-utilization 0.1" \
    --json "$R/soak_vs_vllm.json" > "$R/soak_vs_vllm.log" 2>&1; echo "soak_vs_vllm rc $?" >> "$R/soak_vs_vllm.log"
  cat "$R/soak_vs_vllm.log"
fi
cp /tmp/pytest-of-*/pytest-*/gpu*/guard.log "$R/gpu_guard.log" 2>/dev/null
for f in /tmp/bench-recycle-*/guard.log; do [ -f "$f" ] && cp "$f" "$R/bench_recycle_guard.log"; done
tar -czf "$OUT/results.tar.gz" --exclude=vllm-cache --exclude=triton-cache --exclude='*.sock' -C /tmp results
ls -la "$R"; tail -5 "$R/gpu_tests.log" 2>/dev/null; cat "$R/bench_proxy_gpu.json" 2>/dev/null | head -30
