#!/bin/bash
# Waits on a bg.sh run of defaults.sh and ends it once its guard has done N recycles: SIGINT to the
# bench alone (not to `timeout`, which would pass a second one on), whose finally blocks stop the
# guard and copy the ledger; defaults.sh then writes its tarball as at its deadline. Prints, first,
# what shows whether EngineCore was forked and guarded (runtime events, EngineCore's own plugin lines,
# its environment). Then `bg.sh wait NAME 5` copies the results out.
#   bash docs/dev/gpu-stage/stopat.sh NAME SCENARIO N [SECONDS]
set -u
name=$1 sc=$2 n=$3 limit=${4:-540}
log=/tmp/$name/$sc/server.log; gens=/tmp/st-$name/$sc/logs; t=$(date +%s); sent=0
count() { local n; n=$(grep -c '"recycle_done"' "$log" 2>/dev/null); echo "${n:-0}"; }  # grep -c prints 0 and fails when none
echo "== peek at $(date -u +%T): runtime events"
grep -h '"gpu_engine_fork"\|"gpu_mega_aot_artifact"\|"generation_parked"\|"recycle_done"' "$log" 2>/dev/null | cut -c1-260 | tail -6
echo "== EngineCore's own plugin lines (first generations)"
for f in $(ls "$gens"/generation-*.log 2>/dev/null | head -3); do
  echo "-- $f"; grep -h 'vllm-guard\|multiproc\|MULTIPROC\|spawn\|fork' "$f" | grep -v '^\s*$' | cut -c1-220 | head -14
done
echo "== EngineCore environments"; sort -u /tmp/$name-env.raw 2>/dev/null | cut -d' ' -f2- | sort | uniq -c | head
while [ ! -e /tmp/bg/$name/rc ] && [ $(( $(date +%s) - t )) -lt "$limit" ]; do
  if [ $sent = 0 ] && [ "$(count)" -ge "$n" ]; then
    echo "$(count) recycles done at $(date -u +%T): SIGINT to the bench"
    pkill -INT -f "^python3 bench/gpu_serving.py" && sent=1
  fi
  sleep 5
done
echo "recycles so far: $(count); ended: $([ -e /tmp/bg/$name/rc ] && echo yes || echo no)"
