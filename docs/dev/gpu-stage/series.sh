#!/bin/bash
# The whole side-by-side series of one card, back to back in one detached run (bg.sh), each
# scenario its own defaults.sh run and tarball (so a machine taken back mid-run still leaves the
# finished ones in the run's OUT): plain vLLM (pristine, 900 prompts), gated24 (--max-requests 600,
# 1 800 prompts), kills24 (2 100 prompts, kills at 90 and 190 s; KPROMPTS and KILLS shorten it),
# overlap80 (--max-requests 300, 900 prompts), in the order of ONLY (plain2: a second pristine run,
# an A/A control; overlap80np: overlap80 with the standby's start unpaced, [patches] pace_beside = 0;
# overlap80pin: overlap80 with the standby's start on a quarter of the CPUs, [server] start_cpus = "auto";
# overlap80p4: overlap80 paced at 4, [patches] pace_beside = 4;
# guarded: one generation behind the guard, no recycle, no standby: the guard's own path against plain);
# OPROMPTS (default 900) sets the prompts of plain, plain2 and the overlaps, ODEADLINE (300 s) the
# overlaps' deadline (overlap80b: a second paced overlap run, plain3: a third plain one); then each
# overlap run's TTFT p99 against the plain runs with its interval (bench/series_compare.py);
# then, while SWEEP_S > 0, the decode sweep of SIZES beside an A/A control.
# On a staged device (r.sh 4); on a fresh H100 the four took ~990 s with KPROMPTS=1500 (2026-12-07):
#   bash docs/dev/gpu-stage/bg.sh start series env SWEEP_S=240 SIZES=174-256 bash docs/dev/gpu-stage/series.sh
#   bash docs/dev/gpu-stage/bg.sh wait series 560      # back to back until it has ended
set -u
d=docs/dev/gpu-stage
one() {  # NAME DEADLINE SCENARIO PROMPTS [BENCH_ARGS] -- [serve flags]
  local name=$1 dl=$2 sc=$3 n=$4 ba=${5:-}; shift 5
  echo "=== $name ($sc, $n prompts) at $(date -u +%T)"
  T0=$(date +%s) DEADLINE=$dl SCENARIOS=$sc PROMPTS=$n BENCH_ARGS="$ba" bash $d/defaults.sh "$name" "$@"
}
ONLY=${ONLY:-"plain gated24 kills24 overlap80"}
# plain's deadline grows with its prompts: the series' first run also compiles afresh (~200 s
# before its first request on a fresh H100), and 330 s cut 1 500 prompts at 1 397 (2026-12-07)
PDL=$(( ${OPROMPTS:-900} / 10 + 240 ))
bases=""; runs=""  # for the comparison at the end: plain runs are its bases, overlaps and guarded its runs
for sc in $ONLY; do
  res=""; role=run
  case $sc in
  plain|plain2|plain3) one s-$sc $PDL plain "${OPROMPTS:-900}" ""; res=/tmp/s-$sc/plain; role=base ;;  # plain2, plain3: A/A controls
  gated24) one s-gated24 420 gated24 1800 "" --max-requests 600 ;;
  kills24) one s-kills24 400 kills24 "${KPROMPTS:-2100}" "--kill-at ${KILLS:-90 190}" ;;
  overlap80|overlap80b)  # overlap80b: a second paced run
    one s-$sc "${ODEADLINE:-300}" overlap80 "${OPROMPTS:-900}" "" --max-requests 300; res=/tmp/s-$sc/overlap80 ;;
  overlap80pin)  # the standby's start on the last quarter of the CPUs, [server] start_cpus = "auto"
    one s-overlap80pin "${ODEADLINE:-300}" overlap80 "${OPROMPTS:-900}" '--server start_cpus="auto"' --max-requests 300
    res=/tmp/s-overlap80pin/overlap80 ;;
  overlap80p4)  # the standby's start paced at 4 (the default 2): the paced capture leaves the serving engine more
    one s-overlap80p4 "${ODEADLINE:-300}" overlap80 "${OPROMPTS:-900}" "--patches pace_beside=4" --max-requests 300
    res=/tmp/s-overlap80p4/overlap80 ;;
  overlap80np)  # unpaced
    one s-overlap80np "${ODEADLINE:-300}" overlap80 "${OPROMPTS:-900}" "--patches pace_beside=0" --max-requests 300
    res=/tmp/s-overlap80np/overlap80 ;;
  guarded)  # the guard alone, nothing beside
    one s-guarded "${ODEADLINE:-300}" guarded80 "${OPROMPTS:-900}" "--standby off"; res=/tmp/s-guarded/guarded80 ;;
  esac
  if [ -n "$res" ] && [ -f "$res/vllm_bench.json" ]; then
    if [ $role = base ]; then bases="$bases --base $sc=$res"; else runs="$runs $sc=$res"; fi
  fi
done
# each overlap (and guarded) run's TTFT p99 against the plain runs, with its interval (bench/series_compare.py)
[ -n "$bases" ] && [ -n "$runs" ] && python3 bench/series_compare.py $bases $runs
if [ "${SWEEP_S:-0}" -gt 0 ]; then
  echo "=== decode sweep ${SIZES:-174-256} at $(date -u +%T), budget ${SWEEP_S} s"
  export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
  mkdir -p /tmp/decode
  python3 bench/gpu_decode_sweep.py --out /tmp/decode --model /tmp/llama7b --tokenizer /tmp/tiny \
    --config plain=VLLM_PLUGINS= \
    --config 'guard=VLLM_USE_MEGA_AOT_ARTIFACT=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True' \
    --config plain2=VLLM_PLUGINS= --sizes "${SIZES:-174-256}" --budget-s "$SWEEP_S" --recheck-reserve-s 25 \
    > /tmp/decode/sweep.log 2>&1
  echo "sweep rc=$?"; tail -c 1500 /tmp/decode/sweep.log
  tar cJf "${OUT:-/tmp/out}/decode.tar.xz" -C /tmp decode
fi
echo "=== series done at $(date -u +%T)"
