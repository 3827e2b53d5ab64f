"""The shipped fleet configs: the Kubernetes manifests validate against Kubernetes' own schemas
(kubernetes-validate's bundled OpenAPI schemas, strict: an unknown field is an error; offline), the
ConfigMap is built from the same guard.toml a systemd box installs, and every number the manifests
take from it agrees with it; HAProxy's and nginx's example configs pass their own checkers."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from conftest import ROOT
from vllm_guard.core import config as C
from vllm_guard.runtime.frontdoor import routes
from vllm_guard.runtime.frontdoor.proxy import LIVENESS_STALE_S
from vllm_guard.systemd.install import stop_timeout

K8S = ROOT / "deploy" / "kubernetes"
# Kubernetes releases whose schemas the package bundles, from 1.32 (the preStop sleep action is GA there)
VERSIONS = sorted({v for v in all_versions() if v >= "1.32"}, key=lambda v: tuple(map(int, v.split("."))))


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def resources() -> list[dict[str, Any]]:
    """What `kubectl apply -k` creates: the listed files, and the ConfigMap generated from guard.toml."""
    k = kustomization()
    out: list[dict[str, Any]] = []
    for name in k["resources"]:
        out += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    for gen in k["configMapGenerator"]:
        data = {f: (K8S / f).read_text() for f in gen["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [r for r in resources() if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def container() -> dict[str, Any]:
    return one("StatefulSet")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", [VERSIONS[0], VERSIONS[-1]])
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    docs = resources()
    assert {d["kind"] for d in docs} == {"StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap"}
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}, "a manifest is not in kustomization"
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)  # raises ValidationError


def test_the_validation_can_fail() -> None:
    """A misspelled field and a wrong type are both refused (strict schemas)."""
    sts = one("StatefulSet")
    typo = copy.deepcopy(sts)
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/", "port": 1}}
    wrong = copy.deepcopy(sts)
    wrong["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "250s"
    for bad in (typo, wrong):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_the_pod_and_a_systemd_box_read_one_guard_toml() -> None:
    """The ConfigMap is guard.toml as it is; the pod mounts it where `serve --config` reads it; the
    file is one the guard accepts, and serves on the network (the balancer, Prometheus)."""
    cm = one("ConfigMap")
    text = cm["data"]["guard.toml"]
    assert text == (K8S / "guard.toml").read_text()
    cfg = C.from_data(C.tomllib.loads(text))  # every section checked, as `install` and `serve` do
    c = container()
    assert c["command"][:4] == ["vllm-guard", "serve", "--config", "/etc/vllm-guard/guard.toml"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    vol = next(v for v in one("StatefulSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    assert mount["mountPath"] == "/etc/vllm-guard" and vol["configMap"]["name"] == cm["metadata"]["name"]
    state = next(m for m in c["volumeMounts"] if m["name"] == "state")
    assert state["mountPath"] == cfg.server.state_dir
    assert any(m["mountPath"] == str(Path(cfg.server.model).parent) for m in c["volumeMounts"])
    assert cfg.server.host == "0.0.0.0" and cfg.server.metrics_addr == "0.0.0.0"


def test_the_manifest_takes_its_numbers_from_guard_toml() -> None:
    cfg = C.from_data(C.tomllib.loads((K8S / "guard.toml").read_text()))
    s = cfg.server
    pod = one("StatefulSet")["spec"]["template"]
    spec, c = pod["spec"], container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": s.port, "metrics": s.metrics_port}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(s.metrics_port)
    # probes on the guard's own endpoints, on the public port
    assert c["readinessProbe"]["httpGet"] == {"path": routes.READY_PATH, "port": "http"}
    assert c["livenessProbe"]["httpGet"] == c["startupProbe"]["httpGet"] == {"path": routes.LIVE_PATH, "port": "http"}
    # the balancer notices unreadiness (period x failures) within the lead time before a gap
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r["failureThreshold"] < s.unready_lead
    # a frozen loop: stale after LIVENESS_STALE_S, restarted after the probe's failures too
    lp = c["livenessProbe"]
    assert LIVENESS_STALE_S + lp["periodSeconds"] * lp["failureThreshold"] <= cfg.install.watchdog_sec
    # the grace period covers the preStop sleep and the whole way out of a draining generation
    sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert sleep >= s.unready_lead
    assert spec["terminationGracePeriodSeconds"] >= sleep + stop_timeout(cfg)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    labels = pod["metadata"]["labels"]
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one("Service", "vllm-guard")["spec"]["selector"].items() <= labels.items()


def test_haproxy_config_passes_haproxy_and_checks_readiness(tmp_path: Path) -> None:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    assert Path(haproxy).exists(), "haproxy not installed (.ci/system-deps installs Debian's package)"
    cfg = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
    out = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"http-check send meth GET uri {routes.READY_PATH}" in cfg.read_text()
    bad = tmp_path / "bad.cfg"
    bad.write_text(cfg.read_text().replace("balance leastconn", "balance fastest"))
    assert subprocess.run([haproxy, "-c", "-f", str(bad)], capture_output=True, timeout=600).returncode != 0


def test_nginx_config_passes_nginx(tmp_path: Path) -> None:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "nginx not installed (.ci/system-deps installs Debian's nginx-light)"
    conf = ROOT / "deploy" / "nginx" / "vllm-guard.conf"
    assert routes.READY_PATH in conf.read_text()
    main = tmp_path / "nginx.conf"
    main.write_text(f"pid {tmp_path}/nginx.pid;\nerror_log stderr;\nevents {{}}\nhttp {{ include {conf}; }}\n")
    out = subprocess.run([nginx, "-t", "-c", str(main), "-p", str(tmp_path), "-e", "stderr"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "syntax is ok" in out.stderr, out.stdout + out.stderr
    broken = tmp_path / "broken.conf"
    broken.write_text(conf.read_text().replace("least_conn;", "least_conn"))
    main.write_text(f"pid {tmp_path}/nginx.pid;\nerror_log stderr;\nevents {{}}\nhttp {{ include {broken}; }}\n")
    assert subprocess.run([nginx, "-t", "-c", str(main), "-p", str(tmp_path), "-e", "stderr"],
                          capture_output=True, timeout=600).returncode != 0
