#!/bin/bash
# Runs INSIDE the guest, as root, under a real systemd (PID 1), started by vm-test.service.
# The host (tests/vm/test_systemd_vm.py) copies this file into its run dir, bound at /srv/share
# with: bin (the vllm-guard executable's path), base.toml, model/ (the tiny model); the project,
# its venv and the venv's base Python are bound read-only at their own paths.
# Every step appends one JSON line to /srv/share/result.jsonl; the transcript goes to
# /srv/share/transcript.log. The guest powers off when this script ends.
set -u
S=/srv/share
exec > >(tee -a "$S/transcript.log") 2>&1
VG=$(cat "$S/bin")
PORT=8000
STATE=/var/lib/vllm-guard
URL=http://127.0.0.1:$PORT

say() { echo; echo "### $(date -u +%H:%M:%S) $*"; }
result() {  # step ok(true|false) detail
  python3_escape=$(printf '%s' "$3" | tr '"\\\n' "''  ")
  echo "{\"step\": \"$1\", \"ok\": $2, \"detail\": \"$python3_escape\", \"t\": \"$(date -u +%H:%M:%S)\"}" >> "$S/result.jsonl"
  echo ">>> step $1: ok=$2 $3"
}
status_json() { "$VG" status --state-dir "$STATE" --json 2>/dev/null; }
field() {  # field EXPR: evaluate a Python expression on the status JSON (s)
  status_json | "$PY" -c "import json,sys; s=json.load(sys.stdin); print($1)" 2>/dev/null
}
wait_for() {  # wait_for SECONDS EXPR: until the Python expression on status is True
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    [ "$(field "$2")" = "True" ] && return 0
    sleep 2
  done
  return 1
}
complete() {  # one short completion; prints the HTTP code
  curl -s -o /tmp/completion.json -w '%{http_code}' "$URL/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"hello\", \"max_tokens\": 8}"
}
PY=$(dirname "$VG")/python

say "guest: $(uname -r), systemd $(systemctl --version | head -1), PID 1 = $(ps -p 1 -o comm=), $(nproc) vCPUs"
MODEL=$S/model

say "install (preflight: root, systemd as PID 1, port free, driver check)"
t0=$SECONDS
"$VG" install --model "$MODEL" --port $PORT --config "$S/base.toml"
rc=$?
result install "$([ $rc = 0 ] && echo true || echo false)" "exit $rc after $((SECONDS - t0)) s (its systemctl start returns after READY=1)"
systemctl --no-pager status vllm-guard.service | head -12
state=$(systemctl show -p ActiveState --value vllm-guard.service)
text=$(systemctl show -p StatusText --value vllm-guard.service)
result ready "$([ "$state" = active ] && echo true || echo false)" "ActiveState=$state StatusText=$text"
grep -E '^(User|ProtectSystem|ProtectHome|OOMPolicy|KillMode|WatchdogUSec|TimeoutStopUSec|Type)=' \
  <(systemctl show vllm-guard.service) | tr '\n' ' '; echo
ls -la "$STATE"

say "a request served"
code=$(complete); cat /tmp/completion.json; echo
result request "$([ "$code" = 200 ] && echo true || echo false)" "HTTP $code"

say "kill -9 of the engine"
main_before=$(systemctl show -p MainPID --value vllm-guard.service)
gen_before=$(field "s['generation']")
engine=$(field "[c['pid'] for c in s['children'] if c['role']=='engine_core'][0]")
ps -o pid,user,comm,args -p "$engine" | cut -c1-120
kill -9 "$engine"
t0=$SECONDS
if wait_for 600 "s['state']=='serving' and s['generation']>$gen_before"; then
  code=$(complete)
  main_after=$(systemctl show -p MainPID --value vllm-guard.service)
  nrestarts=$(systemctl show -p NRestarts --value vllm-guard.service)
  ok=$([ "$code" = 200 ] && [ "$main_after" = "$main_before" ] && echo true || echo false)
  result kill9_restored "$ok" "restored in $((SECONDS - t0)) s: generation $gen_before -> $(field "s['generation']"), HTTP $code, runtime MainPID $main_before -> $main_after, systemd NRestarts=$nrestarts, failures=$(field "s['failures']")"
else
  result kill9_restored false "not serving again after 600 s: $(status_json | head -c 400)"
fi

say "systemctl reload with a request in flight"
gen_before=$(field "s['generation']")
# Eight long streams (4000 tokens each) so the engine is busy for many seconds and they are
# surely running when the recycle starts (one stream alone can finish first on an idle box).
curl_pids=""
for i in 2 3 4 5 6 7 8; do
  curl -sN "$URL/v1/completions" -H 'Content-Type: application/json' -o /tmp/stream$i.txt -w '%{http_code}' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"hello\", \"max_tokens\": 4000, \"ignore_eos\": true, \"stream\": true}" \
    > /tmp/stream$i.code &
  curl_pids="$curl_pids $!"
done
curl -sN "$URL/v1/completions" -H 'Content-Type: application/json' -o /tmp/stream.txt -w '%{http_code}' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"hello\", \"max_tokens\": 4000, \"ignore_eos\": true, \"stream\": true}" \
  > /tmp/stream.code &
curl_pid=$!
for _ in $(seq 1 300); do [ -s /tmp/stream.txt ] && break; sleep 0.1; done
# reload re-reads guard.toml and recycles only when the runtime's configuration changed: a vLLM
# argument (the next generation must run with it)
"$PY" - <<'PYEOF'
import pathlib, re
p = pathlib.Path("/etc/vllm-guard/guard.toml")
t = p.read_text()
new = re.sub(r'(?m)^(vllm_args = \[.*)\][ \t]*$', r'\1, "--max-num-seqs", "8"]', t, count=1)
print("guard.toml vllm_args:", [l for l in new.splitlines() if l.startswith("vllm_args")])
p.write_text(new)
PYEOF
systemctl reload vllm-guard.service
reload_rc=$?
reload_at=$(date +%s.%N)
wait $curl_pid
stream_end=$(date +%s.%N)
wait $curl_pids
others_done=$(cat /tmp/stream[2-8].txt | grep -c '^data: \[DONE\]')
chunks=$(grep -c '^data: {' /tmp/stream.txt)
done_seen=$(grep -c '^data: \[DONE\]' /tmp/stream.txt)
finish=$(grep -o '"finish_reason":"[a-z]*"' /tmp/stream.txt | tail -1)
after=$(awk -v a="$reload_at" -v b="$stream_end" 'BEGIN{printf "%.1f", b - a}')
if wait_for 600 "s['state']=='serving' and s['generation']>$gen_before"; then
  rec_in_flight=$(field "s['recent_recycles'][-1]['in_flight']")
  rec=$(field "[(r['reason'], r['in_flight'], r['duration_s']) for r in s['recent_recycles']][-1]")
  code=$(complete)
  api=$(field "[c['pid'] for c in s['children'] if c['role']=='api_server'][0]")
  seqs=$(tr '\0' '\n' < /proc/$api/cmdline | grep -A1 -x -- --max-num-seqs | tail -1)
  ok=$([ $reload_rc = 0 ] && [ "$(cat /tmp/stream.code)" = 200 ] && [ "$done_seen" = 1 ] && [ "$finish" = '"finish_reason":"length"' ] \
       && [ "$others_done" = 7 ] \
       && [ "${rec_in_flight:-0}" -ge 1 ] && [ "$code" = 200 ] && [ "$seqs" = 8 ] && echo true || echo false)
  result reload_graceful "$ok" "reload rc=$reload_rc; the new API server runs --max-num-seqs $seqs; the stream ended $after s after the reload: HTTP $(cat /tmp/stream.code), $chunks chunks, $finish, [DONE]=$done_seen (and $others_done/7 beside it); recycle (reason, in_flight, duration_s)=$rec; generation $gen_before -> $(field "s['generation']"); next request HTTP $code; failed requests $(field "s['requests']['failed']")"
else
  result reload_graceful false "not serving after reload: $(status_json | head -c 400)"
fi

say "systemctl restart under load: an upgrade that refuses no connection and adopts vLLM"
main_before=$(systemctl show -p MainPID --value vllm-guard.service)
gen_before=$(field "s['generation']")
api_before=$(field "[c['pid'] for c in s['children'] if c['role']=='api_server'][0]")
since=$(date -u '+%Y-%m-%d %H:%M:%S')
rm -f /tmp/upgrade_load.txt
# open loop: a short completion every 0.2 s for 40 s, each on a new connection (HTTP code, first byte)
( for _ in $(seq 1 200); do
    curl -s -o /dev/null -w '%{http_code} %{time_starttransfer} %{exitcode} %{time_connect}\n' --max-time 300 "$URL/v1/completions" \
      -H 'Content-Type: application/json' -d "{\"model\": \"$MODEL\", \"prompt\": \"hello\", \"max_tokens\": 8}" \
      >> /tmp/upgrade_load.txt &
    sleep 0.2
  done; wait ) &
load_pid=$!
sleep 8
t0=$SECONDS
systemctl restart vllm-guard.service
restart_rc=$?
restart_s=$((SECONDS - t0))
wait $load_pid
main_after=$(systemctl show -p MainPID --value vllm-guard.service)
api_after=$(field "[c['pid'] for c in s['children'] if c['role']=='api_server'][0]")
gen_after=$(field "s['generation']")
total=$(grep -c . /tmp/upgrade_load.txt)
served=$(grep -c '^200 ' /tmp/upgrade_load.txt)
refused=$(grep -c '^000 ' /tmp/upgrade_load.txt)
ttfb_max=$(awk '{print $2}' /tmp/upgrade_load.txt | sort -n | tail -1)
adopted=$(journalctl -u vllm-guard.service --since "$since" --no-pager -o cat | grep -c '"generation_adopted"')
job=$(journalctl -u vllm-guard.service --since "$since" --no-pager -o cat | grep -o '"event": "systemd_job"[^}]*' | head -1)
ok=$([ $restart_rc = 0 ] && [ "$total" = 200 ] && [ "$served" = 200 ] && [ "$main_after" != "$main_before" ] \
     && [ "$api_after" = "$api_before" ] && [ "$gen_after" = "$gen_before" ] && [ "$adopted" -ge 1 ] && echo true || echo false)
grep -v '^200 ' /tmp/upgrade_load.txt | head -5
journalctl -u vllm-guard.service --since "$since" --no-pager -o cat \
  | grep -E 'systemd_job|handing_over|handed_over|handover|adopted|proxy_listening|drain_timeout|runtime_exited|error' | cut -c1-300 | head -30
result upgrade_by_restart "$ok" "restart rc=$restart_rc in $restart_s s; $served/$total served, $refused refused; first byte max ${ttfb_max} s; runtime MainPID $main_before -> $main_after; vLLM API server $api_before -> $api_after; generation $gen_before -> $gen_after; adopted=$adopted; $job"

say "the watchdog unit acts through the admin socket, without root"
id vllm-guard-watchdog
ls -la "$STATE/admin.sock"
runuser -u nobody -- "$VG" status --state-dir "$STATE" >/tmp/nobody.txt 2>&1
nobody_rc=$?
ok=$([ $nobody_rc != 0 ] && grep -qiE "permission denied|no runtime at" /tmp/nobody.txt && echo true || echo false)
result admin_denied_to_others "$ok" "user nobody: exit $nobody_rc: $(tail -1 /tmp/nobody.txt)"
gen_before=$(field "s['generation']")
if "$VG" watchdog --help >/dev/null 2>&1; then
  say "the real watchdog, started through its unit as installed (Type=notify, WatchdogSec)"
  systemctl start --no-block vllm-guard-watchdog.service; sleep 30
  wd_state=$(systemctl show -p ActiveState --value vllm-guard-watchdog.service)
  result watchdog_unit_runs "$([ "$wd_state" = active ] && echo true || echo false)" \
    "$(systemctl show -p ActiveState,SubState,Result,User vllm-guard-watchdog.service | tr '\n' ' ')"
  journalctl -u vllm-guard-watchdog.service --no-pager -o cat | grep -E "Error|error|Failed|Started|Timeout|timed out" | cut -c1-200 | tail -8
  systemctl stop vllm-guard-watchdog.service
fi
# The watchdog's action path, through its own unit (its user, groups, sandbox): a drop-in runs
# the admin command the watchdog uses for a preventive recycle, once.
mkdir -p /run/systemd/system/vllm-guard-watchdog.service.d
cat > /run/systemd/system/vllm-guard-watchdog.service.d/vm-test.conf <<EOF
[Service]
Type=oneshot
ExecStart=
ExecStart=$VG recycle --state-dir $STATE --reason watchdog-unit-test --class preventive
WatchdogSec=0
Restart=no
EOF
systemctl daemon-reload
systemctl start vllm-guard-watchdog.service
wd_rc=$?
journalctl -u vllm-guard-watchdog.service --no-pager -n 5 -o cat
wd_user=$(systemctl show -p User --value vllm-guard-watchdog.service)
if wait_for 600 "s['state']=='serving' and s['generation']>$gen_before"; then
  rec=$(field "[(r['reason'], r['cls']) for r in s['recent_recycles']][-1]")
  ok=$([ $wd_rc = 0 ] && [[ "$rec" == *watchdog-unit-test* ]] && echo true || echo false)
  result watchdog_acts "$ok" "unit ran as User=$wd_user (rc $wd_rc); runtime recycled: $rec; generation $gen_before -> $(field "s['generation']")"
else
  result watchdog_acts false "no recycle after the watchdog unit ran (rc $wd_rc)"
fi
rm -rf /run/systemd/system/vllm-guard-watchdog.service.d; systemctl daemon-reload

say "start limit and the revive timer's service"
unit_prop() { systemctl show -p "$1" --value vllm-guard.service; }
wait_unit() {  # wait_unit SECONDS ActiveState [Result]
  local end=$((SECONDS + $1))
  while [ $SECONDS -lt $end ]; do
    [ "$(unit_prop ActiveState)" = "$2" ] && { [ -z "${3:-}" ] || [ "$(unit_prop Result)" = "$3" ]; } && return 0
    sleep 1
  done
  return 1
}
fail_with() {  # replace the runtime by an exit code, through a runtime drop-in
  mkdir -p /run/systemd/system/vllm-guard.service.d
  printf '[Service]\nExecStart=\nExecStart=/bin/sh -c "exit %s"\n' "$1" > /run/systemd/system/vllm-guard.service.d/fail.conf
  systemctl daemon-reload
}
fail_with 2
systemctl stop vllm-guard.service
systemctl start --no-block vllm-guard.service
wait_unit 60 failed
sleep 7  # longer than RestartSec: a restart would have begun
props2=$(systemctl show -p ActiveState,Result,ExecMainStatus,NRestarts vllm-guard.service | tr '\n' ' ')
systemctl start vllm-guard-revive.service
journalctl -u vllm-guard-revive.service --no-pager -o cat | grep "vllm-guard.service:" | tail -1
still=$(unit_prop ActiveState)
ok=$([[ "$props2" == *"ExecMainStatus=2"* ]] && [[ "$props2" == *"NRestarts=0"* ]] && [ "$still" = failed ] && echo true || echo false)
result exit2_not_restarted "$ok" "$props2; after revive: $still (config errors wait for an operator)"
fail_with 3
systemctl reset-failed vllm-guard.service
systemctl start --no-block vllm-guard.service
# Restart=on-failure restarts it StartLimitBurst (4) times, then systemd gives up: failed for good
# (systemd 252 keeps Result=exit-code and logs "Start request repeated too quickly").
end=$((SECONDS + 180))
while [ $SECONDS -lt $end ] && ! { [ "$(unit_prop ActiveState)" = failed ] && [ "$(unit_prop NRestarts)" = 4 ]; }; do sleep 1; done
sleep 7  # longer than RestartSec: no further restart may begin
props3=$(systemctl show -p ActiveState,Result,ExecMainStatus,NRestarts vllm-guard.service | tr '\n' ' ')
gave_up=$(journalctl -u vllm-guard.service --no-pager -o cat | grep -c "Start request repeated too quickly")
rm -rf /run/systemd/system/vllm-guard.service.d
systemctl daemon-reload
t0=$SECONDS
systemctl start vllm-guard-revive.service
revive_line=$(journalctl -u vllm-guard-revive.service --no-pager -o cat | grep "vllm-guard.service:" | tail -1)
echo "$revive_line"
if wait_unit 600 active && wait_for 60 "s['state']=='serving'"; then
  code=$(complete)
  ok=$([[ "$props3" == *"ActiveState=failed"* ]] && [[ "$props3" == *"NRestarts=4"* ]] && [ "$gave_up" -ge 1 ] \
       && [ "$code" = 200 ] && echo true || echo false)
  result revive_after_start_limit "$ok" "$props3 (start limit hit: $gave_up); revive: $revive_line; active and serving $((SECONDS - t0)) s later, HTTP $code"
else
  result revive_after_start_limit false "$props3; revive: $revive_line; not active after 600 s"
fi

say "clean stop"
t0=$SECONDS
systemctl stop vllm-guard.service
stop_rc=$?
props=$(systemctl show -p ActiveState,Result,ExecMainStatus vllm-guard.service | tr '\n' ' ')
left=$(ps -eo comm | grep -c '^VLLM::')
ok=$([ $stop_rc = 0 ] && [[ "$props" == *"ActiveState=inactive"* ]] && [[ "$props" == *"Result=success"* ]] && [ "$left" = 0 ] && echo true || echo false)
result clean_stop "$ok" "stop took $((SECONDS - t0)) s; $props; VLLM processes left: $left"

say "uninstall keeps the ledger"
"$VG" uninstall
ok=$([ ! -e /etc/systemd/system/vllm-guard.service ] && [ -s "$STATE/ledger.sqlite" ] && echo true || echo false)
result uninstall "$ok" "$(ls "$STATE" | tr '\n' ' ')"

say "journal (last lines)"
journalctl -u vllm-guard.service --no-pager -o cat | grep -E 'runtime_started|generation_ready|generation_failed|recycle|runtime_exited|Started|Stopped|Reload' | cut -c1-220 | tail -30
echo "guest done"
