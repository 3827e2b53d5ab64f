"""The startup gate without a server: the registry's shape check (the engine loads plugins before
it builds the executor), and the plugin in a fresh interpreter named like vLLM's EngineCore:
it parks, waits for the runtime's `open`, goes on; exits when the gate stays shut or when it
cannot park safely; never parks outside EngineCore or when not asked. An EngineCore forked from
the API server (not spawned) loads the plugin again and parks too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_guard.core import plugin as contract
from vllm_guard.core.protocol import GateReport
from vllm_guard.patches import defs, registry
from vllm_guard.patches.gate import EXIT_GATE

VLLM_ROOT = registry.vllm_root()
needs_vllm = pytest.mark.skipif(VLLM_ROOT is None, reason="vllm not installed")

REGISTER = """
import json, multiprocessing, sys
multiprocessing.current_process().name = sys.argv[1]
import vllm_guard.patches as p
p.register()
from vllm_guard.patches.plugin import _STATE
print(json.dumps(_STATE["plugin"].report()))
"""


# -- the shape check ----------------------------------------------------------------------------
def _engine_tree(dst: Path) -> Path:
    assert VLLM_ROOT is not None
    root = dst / "vllm"
    for rel in ("_version.py", "v1/engine/core.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(VLLM_ROOT / rel, root / rel)
    return root


@needs_vllm
def test_the_gate_applies_to_the_installed_vllm_and_its_live_classes() -> None:
    assert VLLM_ROOT is not None
    assert registry.static_check(VLLM_ROOT, defs.T_ENGINE_INIT) is None
    assert registry.evaluate(defs.STARTUP_GATE, registry.tree_version(VLLM_ROOT),
                             lambda t: registry.static_check(VLLM_ROOT, t)) is None


@needs_vllm
def test_an_engine_that_builds_its_executor_before_loading_plugins_is_refused(tmp_path: Path) -> None:
    """If a vLLM moved `load_general_plugins()` after the executor (CUDA), parking there would
    hold GPU memory: the shape check says so and the gate does not apply."""
    root = _engine_tree(tmp_path)
    f = root / "v1" / "engine" / "core.py"
    text = f.read_text()
    load = "        load_general_plugins()\n"
    build = "        self.model_executor = executor_class(vllm_config)\n"
    assert text.count(load) >= 1 and text.count(build) == 1
    text = text.replace(load, "", 1).replace(build, build + load, 1)
    f.write_text(text)
    registry._parse.cache_clear()
    why = registry.static_check(root, defs.T_ENGINE_INIT)
    assert why == ("EngineCore.__init__ calls executor_class before load_general_plugins "
                   "(expected load_general_plugins before executor_class)")


def test_call_order_names_a_missing_call() -> None:
    import ast

    fn = ast.parse("def f(self):\n    build()\n")
    assert registry.call_order(fn, "X.f", ("load", "build")) == "X.f does not call load"
    assert registry.call_order(ast.parse("def f():\n    a.load()\n    build(1)\n"), "X.f", ("load", "build")) is None


# -- the plugin at the gate (a fresh interpreter per case) --------------------------------------
def _start(tmp_path: Path, name: str, timeout: float = 120.0, patches: str = "") -> tuple[subprocess.Popen[str], Path]:
    gate = contract.gate_dir(tmp_path, 7)
    env = contract.gate_env({**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "7",
                             contract.PATCHES_VAR: patches}, gate, timeout)
    proc = subprocess.Popen([sys.executable, "-c", REGISTER, name], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, gate


def _wait_report(gate: Path, proc: subprocess.Popen[str], timeout: float = 300.0) -> GateReport:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rep = contract.read_gate(gate)
        if rep is not None:
            return rep
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} without a gate report: {proc.stderr.read()[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("no gate report in time")


@needs_vllm
def test_engine_core_parks_until_the_gate_opens_then_goes_on(tmp_path: Path) -> None:
    proc, gate = _start(tmp_path, "EngineCore")
    try:
        rep = _wait_report(gate, proc)
        assert rep.state == "parked" and rep.pid == proc.pid and rep.vllm_version.startswith("0.")
        time.sleep(1.0)
        assert proc.poll() is None, "it must wait at the gate"
        # the patches are reported before it parks: the runtime sees them while it waits
        (report,) = contract.read_states(tmp_path, 7).values()
        assert report.patches["startup-gate"].state == "applied"
        contract.open_gate(gate)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    done = contract.read_gate(gate)
    assert done is not None and done.state == "opened" and done.waited_s is not None and done.waited_s >= 1.0
    states = json.loads(out.strip().splitlines()[-1])["patches"]
    assert states["startup-gate"]["state"] == "applied"
    assert states["startup-gate"]["reason"].startswith("parked ")


@needs_vllm
def test_a_gate_that_stays_shut_ends_the_engine(tmp_path: Path) -> None:
    proc, gate = _start(tmp_path, "EngineCore", timeout=1)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_GATE
    rep = contract.read_gate(gate)
    assert rep is not None and rep.state == "timed_out" and rep.reason == "not opened within 1s"
    assert "not opened within 1 s; exiting" in err


@needs_vllm
def test_an_engine_that_cannot_park_says_why_and_exits_instead_of_going_on(tmp_path: Path) -> None:
    proc, gate = _start(tmp_path, "EngineCore", patches="disable=startup-gate")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_GATE
    rep = contract.read_gate(gate)
    assert rep is not None and rep.state == "skipped" and rep.reason == "disabled in [patches]"
    assert "cannot park (disabled in [patches])" in err


@needs_vllm
def test_only_engine_core_parks(tmp_path: Path) -> None:
    proc, gate = _start(tmp_path, "MainProcess")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert contract.read_gate(gate) is None
    states = json.loads(out.strip().splitlines()[-1])["patches"]
    assert states["startup-gate"] == {"state": "skipped", "reason": "not in this process (runs in engine_core)"}


@needs_vllm
def test_a_generation_that_is_not_gated_never_parks(tmp_path: Path) -> None:
    env = {**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "3"}
    r = subprocess.run([sys.executable, "-c", REGISTER, "EngineCore"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    states = json.loads(r.stdout.strip().splitlines()[-1])["patches"]
    assert states["startup-gate"] == {"state": "skipped", "reason": "not a gated generation"}
    assert not contract.gate_dir(tmp_path, 3).exists()


def test_gate_files_round_trip(tmp_path: Path) -> None:
    gate = contract.gate_dir(tmp_path, 2)
    assert contract.read_gate(gate) is None and not contract.gate_is_open(gate)
    gate.mkdir(parents=True)
    (gate / contract.GATE_STATE).write_text('{"state": "parked", "pid": 1')  # torn: not yet a report
    assert contract.read_gate(gate) is None
    (gate / contract.GATE_STATE).write_text(json.dumps({"state": "parked", "pid": 12, "at": "t", "where": "w"}))
    rep = contract.read_gate(gate)
    assert rep is not None and rep.state == "parked" and rep.pid == 12
    contract.open_gate(gate)
    contract.open_gate(gate)
    assert contract.gate_is_open(gate)
    env = contract.gate_env({"A": "1"}, gate, 95.4)
    assert env == {"A": "1", contract.GATE_VAR: str(gate), contract.GATE_TIMEOUT_VAR: "95"}


# -- the warm start at the gate ------------------------------------------------------------------
WARM_REGISTER = """
import json, multiprocessing, sys
multiprocessing.current_process().name = "EngineCore"
import torch
if sys.argv[1] == "prestage-context":  # staging makes this process's CUDA context on purpose
    from vllm_guard.patches import prestage
    def stage(model_dir):
        torch.cuda.is_initialized = lambda: True
        return {"model_dir": str(model_dir), "error": "staged nothing (test)"}
    prestage.stage = stage
import vllm_guard.patches as p
p.register()
from vllm_guard.patches.plugin import _STATE
print(json.dumps(_STATE["plugin"].report()))
"""


def _warm_start(tmp_path: Path, case: str, modules: list[str]) -> tuple[subprocess.Popen[str], Path]:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "warm_mod.py").write_text("X = 1\n")
    (lib / "makes_context.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    listing = contract.warm_imports_path(tmp_path, "engine_core")
    listing.parent.mkdir(parents=True)
    from vllm_guard.patches.plugin import vllm_version

    listing.write_text(json.dumps({"schema": "vllm-guard-warm-imports/1", "role": "engine_core",
                                   "vllm_version": vllm_version(), "recorded_at": "x", "modules": modules}))
    gate = contract.gate_dir(tmp_path, 7)
    env = contract.gate_env({**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "7",
                             "PYTHONPATH": os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")])},
                            gate, 120, prestage=str(tmp_path / "model") if case == "prestage-context" else None,
                            warm=True)
    proc = subprocess.Popen([sys.executable, "-c", WARM_REGISTER, case], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, gate


@needs_vllm
@pytest.mark.parametrize("case", ["plain", "prestage-context"])
def test_a_warm_engine_imports_its_list_then_parks(tmp_path: Path, case: str) -> None:
    """A context the staging made on purpose is not one the warm start made: it parks either way."""
    proc, gate = _warm_start(tmp_path, case, ["warm_mod"])
    try:
        rep = _wait_report(gate, proc)
        assert rep.state == "parked", rep
        assert rep.warm is not None and rep.warm.listed == 1 and rep.warm.imported == 1 and not rep.warm.failed
        assert rep.warm.gc_frozen > 0
        if case == "prestage-context":  # staged (by the stand-in) before the warm start, context and all
            assert rep.prestage is not None and rep.prestage.error == "staged nothing (test)", rep.prestage
        (report,) = contract.read_states(tmp_path, 7).values()
        assert report.warm == rep.warm  # the process report says it too
        contract.open_gate(gate)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]


@needs_vllm
def test_a_warm_start_that_made_a_cuda_context_is_refused(tmp_path: Path) -> None:
    proc, gate = _warm_start(tmp_path, "plain", ["makes_context"])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_GATE, err[-2000:]
    rep = contract.read_gate(gate)
    assert rep is not None and rep.state == "skipped", rep
    assert rep.reason == "CUDA was initialized while importing the warm-start list"


# -- EngineCore forked from the API server (VLLM_WORKER_MULTIPROC_METHOD=fork on a GPU) -----------
FORKED = """
import json, multiprocessing, sys
import vllm.plugins
vllm.plugins.load_general_plugins()  # the API server: vLLM loads its general plugins, ours included
from vllm_guard.patches.plugin import _STATE
assert _STATE["plugin"].role == "api_server" and vllm.plugins.plugins_loaded

def engine_core():  # what vLLM's EngineCore.__init__ does first, in the forked child
    vllm.plugins.load_general_plugins()
    print(json.dumps(_STATE["plugin"].report()), flush=True)

p = multiprocessing.get_context("fork").Process(target=engine_core, name="EngineCore")
p.start()
print(json.dumps({"child": p.pid}), flush=True)
p.join()
sys.exit(p.exitcode)
"""


@needs_vllm
def test_an_engine_core_forked_from_the_api_server_loads_the_plugin_again_and_parks(tmp_path: Path) -> None:
    """vLLM keeps "plugins loaded" per process, and a forked child inherits it set: without our
    at-fork hook a forked EngineCore would run none of its patches and never park."""
    gate = contract.gate_dir(tmp_path, 7)
    env = contract.gate_env({**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "7",
                             "VLLM_PLUGINS": contract.PLUGIN_NAME}, gate, 300)
    proc = subprocess.Popen([sys.executable, "-c", FORKED], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        rep = _wait_report(gate, proc)
        assert rep.state == "parked" and rep.pid != proc.pid  # the forked child parked, not the API server
        roles = {r.process for r in contract.read_states(tmp_path, 7).values()}
        assert roles == {"api_server", "engine_core"}
        contract.open_gate(gate)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    lines = [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]  # not vLLM's log
    assert lines[0]["child"] == rep.pid
    child = lines[-1]
    assert child["process"] == "engine_core" and child["pid"] == rep.pid
    for patch in ("startup-gate", "kv-block-audit"):
        assert child["patches"][patch]["state"] == "applied", (patch, child["patches"][patch])
