#!/bin/bash
# A run longer than one device call (600 s): start it detached, then wait on it from later calls.
# A process started with `setsid nohup` outlives its call while the machine stays warm (seen
# 2026-12-06); the machine goes back after 30 s with no call in flight, so each `wait` call must
# follow the last within 30 s, and the run dies with the machine if one does not.
#   bash docs/dev/gpu-stage/bg.sh start NAME COMMAND...   # returns at once; COMMAND runs in the call's checkout copy
#   bash docs/dev/gpu-stage/bg.sh wait NAME [SECONDS]     # waits up to SECONDS (default 560) for it to end,
#                                                         # prints its log's tail; once ended, copies $OUT of the run
# The run's own OUT is /tmp/bg/NAME/out (defaults.sh writes its tarball there); its log /tmp/bg/NAME/log.
# Example, 20 gated recycles with the leak (~20 min; H200, 2026-12-06: a recycle every ~47-53 s,
# since each generation serves its 300 plus the ~50 that queued in the gap before it; from the
# second generation on each standby is judged at its predecessors' leak rate and parks before
# CUDA; on a fresh machine the first start compiles from scratch, ~90 s more; a higher --rate does
# not shorten it: the cycle is the standby's ~40 s to park, unready_lead and the gap, H100 12-06g):
#   start: bg.sh start leak20 env DEADLINE=1250 SCENARIOS=gated24 PROMPTS=10500 \
#          BENCH_ARGS="--inject device_leak_mb_per_request=2" bash docs/dev/gpu-stage/defaults.sh leak20 --max-requests 300
#   then:  bg.sh wait leak20   (twice or three times, back to back)
set -u
cmd=${1:-}; name=${2:-}
[ -n "$cmd" ] && [ -n "$name" ] || { echo "usage: bg.sh start NAME COMMAND... | wait NAME [SECONDS]" >&2; exit 2; }
d=/tmp/bg/$name
case $cmd in
start)
  shift 2
  [ $# -gt 0 ] || { echo "bg.sh start: no command" >&2; exit 2; }
  [ -e "$d/pid" ] && kill -0 "$(cat "$d/pid")" 2>/dev/null && { echo "bg.sh: $name is already running" >&2; exit 2; }
  rm -rf "$d" && mkdir -p "$d/out" "$d/tree" || exit 1
  cp -a . "$d/tree/" || exit 1  # the call's checkout copy is replaced by the next call's
  ( cd "$d/tree" && OUT="$d/out" T0=$(date +%s) setsid nohup bash -c '"$@"; echo $? > '"$d"'/rc' _ "$@" \
      > "$d/log" 2>&1 < /dev/null & echo $! > "$d/pid" )
  sleep 1
  echo "started $name (pid $(cat "$d/pid")) at $(date -u +%T)" ;;
wait)
  limit=${3:-560}; t=$(date +%s)
  [ -d "$d" ] || { echo "bg.sh: no run named $name (the machine went back?)" >&2; exit 3; }
  while [ ! -e "$d/rc" ] && [ $(( $(date +%s) - t )) -lt "$limit" ]; do sleep 5; done
  tail -c 6000 "$d/log"
  if [ -e "$d/rc" ]; then
    echo "== $name ended: rc=$(cat "$d/rc")"
    mkdir -p "${OUT:-/tmp/out}" && cp -a "$d/out/." "${OUT:-/tmp/out}/"
  else
    echo "== $name still running after $(( $(date +%s) - t )) s: call wait again within 30 s"
    mkdir -p "${OUT:-/tmp/out}" && cp -a "$d/out/." "${OUT:-/tmp/out}/"  # what has finished so far
  fi ;;
*) echo "usage: bg.sh start NAME COMMAND... | wait NAME [SECONDS]" >&2; exit 2 ;;
esac
