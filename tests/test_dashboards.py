"""The shipped Grafana dashboard and Prometheus alert rules: every PromQL expression parses with
real parsers (Prometheus's own `promtool` and the promql-parser port of it), and names only
metrics that the runtime's and the watchdog's registries export (plus Prometheus's `up`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import promql_parser
import yaml

from conftest import ROOT
from test_metrics_runtime import STATUS, make_ledger
from vllm_guard.core.protocol import StatusSnapshot
from vllm_guard.runtime.servers.metrics import RuntimeMetrics
from vllm_guard.watchdog.exporter import Exporter

DASH = ROOT / "dashboards" / "vllm-guard.json"
ALERTS = ROOT / "dashboards" / "alerts.yml"
PROMETHEUS_OWN = {"up"}  # the scrape's own series
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}


def family_names(registry: Any) -> set[str]:
    """Every sample name a registry can expose, also for labelled metrics not set yet."""
    out = set()
    for fam in registry.collect():
        out |= {s.name for s in fam.samples}
        out |= {fam.name + sfx for sfx in SUFFIXES.get(fam.type, ("",))}
    return out


def runtime_metrics(tmp: Path) -> RuntimeMetrics:
    """The runtime's registry with a replica serving and its vLLM page re-exported (a real vLLM
    0.32.0 page), readiness known and one request observed."""
    from test_metrics_runtime import VLLM_PAGE
    from vllm_guard.runtime.frontdoor.done import Outcome, RequestDone

    page = VLLM_PAGE.read_text()
    m = RuntimeMetrics(make_ledger(tmp), fetch=lambda targets: {i: page for i, _ in targets})
    replica = {"index": 0, "state": "serving", "generation": 3, "backend_url": "http+unix://%2Fb.sock",
               "gpu_name": "NVIDIA H200"}
    m.snapshot = StatusSnapshot.from_json({**STATUS, "replicas": [replica]})
    m.ready = True
    m.requests.observe(RequestDone(request_id="r", counted=True, outcome=Outcome.COMPLETED, status=200, reason="",
                                   arrived=0.0, e2e_s=0.8, ttft_s=0.3, replica=0))
    return m


def exported(tmp: Path) -> set[str]:
    return family_names(runtime_metrics(tmp).registry) | family_names(Exporter().registry)


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    d = json.loads(DASH.read_text())
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t['refId']}", t["expr"]
    for a in d["annotations"]["list"]:
        if "expr" in a:
            yield f"annotation {a['name']!r}", a["expr"]


def alert_exprs() -> Iterator[tuple[str, str]]:
    for g in yaml.safe_load(ALERTS.read_text())["groups"]:
        for r in g["rules"]:
            yield f"alert {r['alert']}", r["expr"]


def selectors(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next((m.value for m in node.matchers.matchers if m.name == "__name__"), None)
            assert name, f"selector without a metric name in {expr!r}"
            names.add(name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_expression_parses_and_names_only_our_metrics(tmp_path: Path) -> None:
    ours = exported(tmp_path) | PROMETHEUS_OWN
    exprs = list(dashboard_exprs()) + list(alert_exprs())
    assert len(exprs) >= 40
    used: set[str] = set()
    for where, expr in exprs:
        names = selectors(expr)  # raises on a syntax error
        assert names, (where, expr)
        unknown = names - ours
        assert not unknown, f"{where}: {sorted(unknown)} are not exported (expr {expr!r})"
        used |= names
    # the fleet view covers both exporters and the figures the alerts are about
    for must in ("vllm_guard_runtime_request_outcomes_total", "vllm_guard_runtime_recycles_total",
                 "vllm_guard_runtime_failures_total", "vllm_guard_runtime_stall_seconds",
                 "vllm_guard_time_to_oom_seconds", "vllm_guard_thermal_throttle_share", "vllm_guard_incidents_total",
                 # the fleet view: histograms per replica, vLLM's own series, readiness, GPU models
                 "vllm_guard_runtime_request_ttft_seconds_bucket", "vllm_guard_runtime_request_e2e_seconds_bucket",
                 "vllm:num_requests_running", "vllm:generation_tokens_total", "vllm_guard_runtime_ready",
                 "vllm_guard_runtime_replica_info"):
        assert must in used, must
    # the template variables' metric names too (Grafana's label_values(), not PromQL)
    d = json.loads(DASH.read_text())
    for v in d["templating"]["list"]:
        q = v.get("definition", "")
        for name in re.findall(r"label_values\((\w+)", q):
            assert name in ours, (v["name"], name)


def test_every_bucket_bound_named_exists(tmp_path: Path) -> None:
    """`le="..."` in a query must be a bucket the histogram has, spelled as the exposition spells it
    ("5.0", not "5"): a bound that matches no series makes an SLA share of nothing."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(runtime_metrics(tmp_path).registry).decode()
    buckets: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                buckets.setdefault(s.name, set()).add(s.labels["le"])
    seen = 0
    for where, expr in list(dashboard_exprs()) + list(alert_exprs()):
        for name, le in re.findall(r'(\w+_bucket)\{[^}]*le="([^"]+)"', expr):
            assert le in buckets[name], f"{where}: {name} has no bucket le={le!r} ({sorted(buckets[name])})"
            seen += 1
    assert seen >= 3


def test_a_misspelled_metric_or_bad_syntax_is_caught(tmp_path: Path) -> None:
    """The checks above can fail: a typo in a name and a broken expression are both found."""
    ours = exported(tmp_path)
    assert selectors("rate(vllm_guard_runtime_request_outcome_total[5m])") - ours
    try:
        selectors("sum by (instance (vllm_guard_runtime_generation)")
    except ValueError:
        pass
    else:
        raise AssertionError("a broken expression parsed")


def test_promtool_checks_the_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    """Prometheus's own parser and rule loader (Debian's prometheus package, .ci/system-deps)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not installed (apt-get install prometheus): this test needs Prometheus's parser"
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_exprs())]}]}
    f = tmp_path / "dashboard-rules.yml"
    f.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "rate(foo[5m]"}]}]}))
    assert subprocess.run([promtool, "check", "rules", str(bad)], capture_output=True, timeout=600).returncode != 0


def test_dashboard_is_grafana_json() -> None:
    d = json.loads(DASH.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == "vllm-guard" and d["timezone"] == "utc"
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        gp = p["gridPos"]
        assert 0 <= gp["x"] and gp["x"] + gp["w"] <= 24 and gp["h"] > 0, p["title"]
