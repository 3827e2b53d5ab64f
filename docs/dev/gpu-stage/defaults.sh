#!/bin/bash
# gated24.sh with the runtime's defaults and nothing forced by hand (2026-12-05): no capture list, no
# VLLM_USE_MEGA_AOT_ARTIFACT from the script (unset here, so the runtime's own choice shows: its
# `gpu_mega_aot_artifact` log line, and the variable in each EngineCore's environment, sampled from
# /proc every 10 s into env.txt). On a staged device (go.sh or r.sh 4), from the call's checkout copy:
#   T0=$(date +%s) SCENARIOS="gated24" PROMPTS=3000 bash docs/dev/gpu-stage/defaults.sh NAME [serve flags]
#   T0=$(date +%s) SCENARIOS="plain overlap80" PROMPTS=900 bash docs/dev/gpu-stage/defaults.sh NAME
#   T0=$(date +%s) SCENARIOS=kills24 PROMPTS=2100 BENCH_ARGS="--kill-at 90 190" bash ... NAME
# -> $OUT/NAME.tar.xz (summary, status, ledger, guard and generation logs, vLLM's benchmark) and a
# compact summary on stdout. The bench gets SIGINT at T0 + DEADLINE (default 540 s) so that its
# finally blocks (guard stopped, ledger copied) and the tar still run inside one 600 s device call.
set -u
NAME=$1; shift
SCENARIOS=${SCENARIOS:-gated24}; PROMPTS=${PROMPTS:-1200}; BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=${T0:-$(date +%s)}; DEADLINE=${DEADLINE:-540}
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . >/dev/null 2>&1 || echo "install failed"
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
unset VLLM_USE_MEGA_AOT_ARTIFACT VLLM_WORKER_MULTIPROC_METHOD
echo "script env: $(env | grep '^VLLM_' | tr '\n' ' ')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
( while sleep 10; do
    for p in $(grep -l EngineCore /proc/[0-9]*/cmdline 2>/dev/null | cut -d/ -f3); do
      c=$(tr '\0' ' ' < /proc/$p/cmdline 2>/dev/null | cut -c1-40); case "$c" in ""|grep*) continue ;; esac
      v=$(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep '^VLLM_USE_MEGA_AOT_ARTIFACT=\|^VLLM_WORKER_MULTIPROC_METHOD=' | sort | tr '\n' ' ')
      echo "$p $c $v"
    done
  done ) > /tmp/$NAME-env.raw 2>/dev/null &
SAMPLER=$!
mkdir -p /tmp/$NAME
if [ "${HOLDER_TEST:-0}" = 1 ]; then  # the weight holder over real CUDA IPC first (~20 s)
  VLLM_GUARD_REQUIRE_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_holder_unit.py -k cuda \
    > /tmp/$NAME/holder-test.log 2>&1; echo "holder test rc=$?"; tail -5 /tmp/$NAME/holder-test.log
fi
# every GPU process's memory once a second: the holder's must stay flat across recycles
nvidia-smi --query-compute-apps=timestamp,pid,process_name,used_memory --format=csv,noheader -lms 1000 \
  > /tmp/$NAME/apps.csv 2>/dev/null &
APPS=$!
left=$(( T0 + DEADLINE - $(date +%s) )); [ $left -lt 60 ] && left=60
echo "bench limit ${left} s"
t=$(date +%s)
timeout -s INT -k 90 $left python3 bench/gpu_serving.py $SCENARIOS --out /tmp/$NAME --model /tmp/llama7b --tokenizer /tmp/tiny \
  --num-prompts $PROMPTS --state-root /tmp/st-$NAME --serve-args "$*" $BENCH_ARGS > /tmp/$NAME.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t )) s"
kill $SAMPLER $APPS 2>/dev/null
python3 - /tmp/$NAME/apps.csv <<'PY'
import collections, sys
seen = collections.OrderedDict()
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4 or not parts[3].split()[0].isdigit():
        continue
    ts, pid, name, mib = parts[0], parts[1], parts[2], int(parts[3].split()[0])
    r = seen.setdefault(pid, {"name": name[-40:], "first_ts": ts, "first": mib, "min": mib, "max": mib, "n": 0})
    r.update(last_ts=ts, last=mib, min=min(r["min"], mib), max=max(r["max"], mib), n=r["n"] + 1)
print("GPU processes (MiB): pid name first/min/max/last samples first..last")
for pid, r in seen.items():
    print(f"  {pid} {r['name']} {r['first']}/{r['min']}/{r['max']}/{r['last']} n={r['n']} {r['first_ts']}..{r['last_ts']}")
PY
sort -u /tmp/$NAME-env.raw > /tmp/$NAME/env.txt; echo "EngineCore environments seen:"; cut -d' ' -f2- /tmp/$NAME/env.txt | sort | uniq -c
for sc in $SCENARIOS; do
  d=/tmp/$NAME/$sc; mkdir -p $d
  cp /tmp/st-$NAME/$sc/logs/generation-*.log /tmp/st-$NAME/$sc/logs/holder-*.log $d/ 2>/dev/null
  [ -f $d/ledger.sqlite ] || { [ -f /tmp/st-$NAME/$sc/ledger.sqlite ] && python3 -c "import sqlite3,sys; s=sqlite3.connect(sys.argv[1]); d=sqlite3.connect(sys.argv[2]); s.backup(d)" /tmp/st-$NAME/$sc/ledger.sqlite $d/ledger.sqlite; }
  echo "== $sc: runtime log lines"
  grep -h '"holder_\|"generation_weights"\|"generation_kv"' $d/server.log 2>/dev/null | cut -c1-300 | head -40
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print('holder', [r.get('holder') for r in s['replicas']])" $d/status.json 2>/dev/null
  grep -h '"gpu_mega_aot_artifact"\|"gpu_engine_fork"\|"generation_parked"\|"recycle_begin"\|"recycle_handover"\|"gate_opened"\|"generation_switched"\|"recycle_fallback"\|downtime_s' $d/server.log 2>/dev/null | cut -c1-330
  echo "== $sc: vLLM generation logs mentioning the artifact"
  grep -il 'mega\|aot' $d/generation-*.log 2>/dev/null | head; grep -ih 'mega.aot\|aot artifact\|mega_aot' $d/generation-*.log 2>/dev/null | cut -c1-250 | sort | uniq -c | head -8
done
python3 - /tmp/$NAME/summary.json <<'PY'
import json, sys
try:
    S = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no summary: {e}")
for name, r in S.items():
    if "error" in r:
        print(name, "ERROR", r["error"]); continue
    b = r["bench"]; t = b["ttft_s"]; g = r.get("guard", {})
    f = lambda x: None if x is None else round(x * 1000, 1)
    print(f"{name}: start {r['start_s']} s; completed {b['completed']} failed {b['failed']} short {b['short_outputs']}; "
          f"TTFT ms p50/p99/max {f(t['p50'])}/{f(t['p99'])}/{f(t['max'])}; waited>1s {b['waited_over_1s']}; "
          f"out tok/s {b['output_tok_s']}; ITL ms p50/p99 {f(b['itl_s']['p50'])}/{f(b['itl_s']['p99'])}")
    if g:
        print("  requests", g["requests"], g["status_extra"])
        print("  gaps", g["recycle_gap_s"], "gate->ready", g["gate_to_ready_s"], "mttr", g["mttr_s"])
        for x in g["recycles"]: print("  recycle", x)
        for x in g["failures"]: print("  failure", x)
    if "kills" in r: print("  kills", r["kills"])
    for p in r.get("start_phases") or []:
        ph = p["phases"] or {}
        print("  phases gen", p["generation"], "weights", p.get("weights"), (p.get("weights_note") or "")[:60], {k: (round(v, 2) if isinstance(v, (int, float)) else v) for k, v in ph.items()} if isinstance(ph, dict) else ph)
PY
tar cJf $OUT/$NAME.tar.xz -C /tmp $NAME $NAME.log; ls -la $OUT
echo "total $(( $(date +%s) - T0 )) s since T0"
