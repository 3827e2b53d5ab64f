#!/bin/bash
# The operator's install journey, INSIDE the guest, as root, under a real systemd (PID 1), started
# by vm-test.service (tests/vm/test_install_journey_vm.py copies this file to /srv/share/guest.sh).
# /srv/share holds: bin (the vllm-guard executable's path), base.toml, model/ (the tiny model);
# the project, its venv and the venv's base Python are bound read-only at their own paths.
# Steps: a venv the unit's sandbox hides is refused (one line, exit 2, nothing installed); an
# interpreter without vLLM is refused by the check run through systemd-run; a proper install
# returns after READY; the soak unit runs 5 minutes (restarted once midway: it continues its run);
# `vllm-guard status` and `vllm-guard report` with no flags find the service; uninstall keeps the
# ledger. Each step appends one JSON line to /srv/share/result.jsonl; the guest powers off at the end.
set -u
S=/srv/share
exec > >(tee -a "$S/transcript.log") 2>&1
VG=$(cat "$S/bin")
PY=$(dirname "$VG")/python
BASE_PY=$("$PY" -c 'import sys, os; print(os.path.realpath(sys.executable if sys.prefix == sys.base_prefix else sys._base_executable))')
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
STATE=/var/lib/vllm-guard
SOAK_MIN=${SOAK_MIN:-5}

say() { echo; echo "### $(date -u +%H:%M:%S) $*"; }
result() {  # step ok(true|false) detail
  esc=$(printf '%s' "$3" | tr '"\\\n' "''  ")
  echo "{\"step\": \"$1\", \"ok\": $2, \"detail\": \"$esc\", \"t\": \"$(date -u +%H:%M:%S)\"}" >> "$S/result.jsonl"
  echo ">>> step $1: ok=$2 $3"
}
yes_if() { if "$@"; then echo true; else echo false; fi; }
venv_at() {  # venv_at DIR SHARE(0|1): a venv on the base Python; 1: it sees the project's venv packages
  "$BASE_PY" -m venv --without-pip "$1" || return 1
  if [ "$2" = 1 ]; then
    site=$(ls -d "$1"/lib/python3*/site-packages)
    echo "import site; site.addsitedir('$SITE')" > "$site/project.pth"
  fi
  printf '#!%s/bin/python\nimport sys\nfrom vllm_guard.cli import main\nsys.exit(main())\n' "$1" > "$1/bin/vllm-guard"
  chmod 755 "$1/bin/vllm-guard"
}

say "guest: $(uname -r), $(systemctl --version | head -1), PID 1 = $(ps -p 1 -o comm=)"

say "install from a venv under /tmp: refused (PrivateTmp hides it from the service)"
venv_at /tmp/hidden-venv 1
out=$(/tmp/hidden-venv/bin/vllm-guard install --model "$S/model" --port 8000 --config "$S/base.toml" 2>&1); rc=$?
echo "$out"
lines=$(printf '%s\n' "$out" | grep -c .)
ok=$(yes_if [ $rc = 2 ] && [ "$lines" = 1 ] && grep -q "PrivateTmp=yes" <<<"$out" && [ ! -e /etc/vllm-guard/guard.toml ])
result hidden_venv_refused "$ok" "exit $rc, $lines line(s): $out"

say "install with [server] python = a venv without vLLM: the systemd-run check runs it and refuses"
venv_at /opt/bare-venv 0
chmod -R o+rX /opt/bare-venv
sed 's|^\[server\]$|[server]\npython = "/opt/bare-venv/bin/python"|' "$S/base.toml" > /tmp/bare.toml
out=$("$VG" install --model "$S/model" --port 8000 --config /tmp/bare.toml 2>&1); rc=$?
echo "$out"
ok=$(yes_if [ $rc = 2 ] && grep -q "cannot find vLLM" <<<"$out" && grep -q "checked with systemd-run" <<<"$out" \
     && [ ! -e /etc/vllm-guard/guard.toml ])
result no_vllm_refused_by_systemd_run "$ok" "exit $rc: $(tail -1 <<<"$out")"

say "a proper install: returns after READY"
t0=$SECONDS
"$VG" install --model "$S/model" --port 8000 --config "$S/base.toml"
rc=$?
state=$(systemctl show -p ActiveState --value vllm-guard.service)
result install_ready "$(yes_if [ $rc = 0 ] && [ "$state" = active ])" \
  "exit $rc after $((SECONDS - t0)) s; ActiveState=$state; $(systemctl show -p StatusText --value vllm-guard.service)"
[ $rc = 0 ] || { systemctl status --no-pager vllm-guard.service | head -20; journalctl -u vllm-guard.service --no-pager -o cat | tail -40; }
grep -A12 '^\[recycle\]' /etc/vllm-guard/guard.toml

say "the soak unit, open loop at 1 req/s for $SOAK_MIN min; restarted once: it continues its run"
mkdir -p /etc/vllm-guard/soak
echo "SOAK_ARGS=--state-dir $STATE --scenario custom --prompt-tokens 24 --output-tokens 16 --rate 1 --duration ${SOAK_MIN}m --no-progress" \
  > /etc/vllm-guard/soak/journey.env
t0=$SECONDS
systemctl start vllm-guard-soak@journey.service
sleep 60
systemctl restart vllm-guard-soak@journey.service
end=$((SECONDS + SOAK_MIN * 60 + 300))
while [ $SECONDS -lt $end ] && [ "$(systemctl show -p ActiveState --value vllm-guard-soak@journey.service)" = active ]; do
  sleep 5
done
took=$((SECONDS - t0))
props=$(systemctl show -p Result -p ExecMainStatus -p ActiveState vllm-guard-soak@journey.service | tr '\n' ' ')
runs=$("$PY" -c "import sqlite3; c=sqlite3.connect('file:$STATE/ledger.sqlite?mode=ro', uri=True); print(c.execute(\"SELECT COUNT(*), GROUP_CONCAT(status) FROM runs\").fetchone())")
journalctl -u vllm-guard-soak@journey.service --no-pager -o cat | tail -8
ok=$(yes_if grep -q "Result=success" <<<"$props" && [ "$took" -ge $((SOAK_MIN * 60)) ] && grep -q "(1, 'done')" <<<"$runs")
result soak_unit "$ok" "ended after $took s: $props; runs (count, status)=$runs"

say "vllm-guard status, no flags"
out=$("$VG" status 2>&1); rc=$?
echo "$out"
result status_no_flags "$(yes_if [ $rc = 0 ] && grep -q "serving" <<<"$out")" "exit $rc: $(head -1 <<<"$out")"

say "vllm-guard report, no flags"
out=$("$VG" report 2>&1); rc=$?
echo "$out" | head -40
json=$("$VG" report --format json 2>/dev/null | "$PY" -c 'import json,sys; f=json.load(sys.stdin); print(f["latency"]["requests"], f["latency"]["failed"])')
result report_no_flags "$(yes_if [ $rc = 0 ] && [ -n "$json" ] && [ "${json%% *}" -gt 0 ])" "exit $rc; latency (requests, failed)=($json)"

say "uninstall, no reboot: the ledger stays"
"$VG" uninstall; rc=$?
state=$(systemctl show -p LoadState --value vllm-guard.service)
ledger=$(ls "$STATE" | tr '\n' ' ')
left=$(pgrep -fc "vllm.entrypoints" || true)
ok=$(yes_if [ $rc = 0 ] && [ -f "$STATE/ledger.sqlite" ] && [ "$state" = not-found ] && [ "$left" = 0 ])
result uninstall_keeps_ledger "$ok" "exit $rc; LoadState=$state; $STATE: $ledger; vLLM processes left: $left"
