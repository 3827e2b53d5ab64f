#!/usr/bin/env bash
# The GPU example ledgers and reports in one device call, < 7 min wall, no network:
#   bash .gpu/stage/call2.sh bash bench/gpu_example_ledgers.sh     (after call1.sh; ../shared/gpu/README.md)
# The 7B random-weight shape (served with the tiny model's tokenizer) is built first if missing
# (~17 s). Everything (ledgers, reports, logs, summary.json) goes to /tmp/gpu-examples; $OUT gets
# one tarball of it plus the compare report and the summary (the device returns at most 8 files).
# BUDGET_S (default 390) is the whole script's wall time before the last report; extra arguments
# go to bench/gpu_example_ledgers.py (e.g. --leak-mb 4 --rate 8 --soak 180 --compile).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=/tmp/gpu-examples; rm -rf "$R"; mkdir -p "$R"
export PYTHONPATH=${PYTHONPATH:-/tmp/site} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$SECONDS
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; } > "$R/env.txt" 2>&1
MODEL=${MODEL:-/tmp/llama7b}
if [ ! -f "$MODEL/config.json" ]; then
  timeout 120 python3 .gpu/stage/mk7b.py "$MODEL" > "$R/mk7b.log" 2>&1 || echo "mk7b rc $?" >> "$R/mk7b.log"
fi
left=$(( ${BUDGET_S:-390} - (SECONDS - t0) ))
PYTHONUNBUFFERED=1 timeout -k 20 $(( left + 30 )) python3 bench/gpu_example_ledgers.py --out "$R" --model "$MODEL" \
  --tokenizer /tmp/tiny --deadline "$left" "$@" > "$R/run.log" 2>&1
echo "gpu_example_ledgers rc $? after $((SECONDS - t0)) s" >> "$R/run.log"
tar -C /tmp -czf "$OUT/gpu-examples.tar.gz" gpu-examples
for f in compare.txt compare.json compare.html summary.json run.log; do [ -f "$R/$f" ] && cp "$R/$f" "$OUT/"; done
tail -n 30 "$R/run.log"
