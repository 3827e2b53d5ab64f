"""Warm start without a server, each step in a fresh Python process (sys.modules is the thing under
test): a process records the modules it imported after its recorder was made, in order, leaving
out what another process cannot import by name; a gated process asked for a warm start imports
that list before its gate, freezes its heap, and reports what it did; a list from another vLLM
version or none at all imports nothing and says why; a module that would initialise CUDA at
import fails there instead and leaves torch's CUDA untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from vllm_guard.core import plugin as contract
from vllm_guard.core.protocol import GateReport, WarmImports, decode
from vllm_guard.patches import warmstart


def run(code: str, env: dict[str, str], path: list[Path] | None = None) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    full = {**os.environ, **env}
    if path:
        full["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + [full.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RECORD = """
    import json, sys, importlib.util
    from vllm_guard.patches import warmstart
    rec = warmstart.Recorder("engine_core", warmstart.list_path("engine_core"), "9.9.9")
    import colorsys, wave          # stdlib, not imported by the interpreter itself
    import warm_pkg.sub            # from a folder on sys.path
    spec = importlib.util.spec_from_file_location("by_path_mod", {by_path!r})
    m = importlib.util.module_from_spec(spec); sys.modules["by_path_mod"] = m; spec.loader.exec_module(m)
    rec.record(); first = rec.thread; rec.record()
    first.join(30)
    print(json.dumps({{"n": len(json.load(open(rec.path))["modules"]), "again": rec.thread is first}}))
"""


def make_pkg(root: Path) -> Path:
    (root / "warm_pkg").mkdir(parents=True)
    (root / "warm_pkg" / "__init__.py").write_text("X = 1\n")
    (root / "warm_pkg" / "sub.py").write_text("Y = 2\n")
    (root / "cuda_at_import.py").write_text("import torch\ntorch.cuda._lazy_init()\n")
    return root


def test_a_process_records_what_it_imported_after_its_recorder_in_order(tmp_path: Path) -> None:
    state, lib = tmp_path / "state", make_pkg(tmp_path / "lib")
    loose = tmp_path / "cache" / "k3y.py"
    loose.parent.mkdir()
    loose.write_text("Z = 3\n")
    env = {contract.STATE_DIR_VAR: str(state), contract.GENERATION_VAR: "4"}
    got = run(RECORD.format(by_path=str(loose)), env, [lib])
    assert got["again"] is True and got["n"] >= 4  # written once, from a thread
    w = decode(WarmImports, json.loads((state / "patches" / "warm-imports-engine_core.json").read_text()))
    assert w.role == "engine_core" and w.vllm_version == "9.9.9" and w.generation == "4"
    mods = w.modules
    for name in ("colorsys", "wave", "warm_pkg", "warm_pkg.sub"):
        assert name in mods, mods
    assert mods.index("warm_pkg") < mods.index("warm_pkg.sub")  # parents first, as imported
    assert mods.index("colorsys") < mods.index("wave")
    assert "by_path_mod" not in mods  # loaded by path from a folder not on sys.path
    assert not any(m.startswith(("vllm_guard", "__main__")) for m in mods)


REPLAY = """
    import gc, json, sys
    import torch
    from vllm_guard.patches import warmstart
    before = {{m: m in sys.modules for m in {names!r}}}
    rep = warmstart.replay("engine_core", {version!r}, freeze=True)
    print(json.dumps({{"rep": rep.model_dump(mode="json"), "before": before,
                      "after": {{m: m in sys.modules for m in {names!r}}},
                      "cuda": torch.cuda.is_initialized(), "frozen": gc.get_freeze_count(),
                      "lazy_init_restored": torch.cuda._lazy_init.__name__}}))
"""


def write_list(state: Path, modules: list[str], version: str = "9.9.9") -> None:
    p = contract.warm_imports_path(state, "engine_core")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"schema": "vllm-guard-warm-imports/1", "role": "engine_core", "vllm_version": version,
                             "recorded_at": "2026-12-03T00:00:00Z", "modules": modules}))


def gated_env(state: Path) -> dict[str, str]:
    return {contract.STATE_DIR_VAR: str(state), contract.GATE_VAR: str(state / "gate"), contract.WARM_VAR: "1"}


def test_a_gated_process_imports_the_list_before_its_gate_and_freezes_its_heap(tmp_path: Path) -> None:
    state, lib = tmp_path / "state", make_pkg(tmp_path / "lib")
    names = ["colorsys", "warm_pkg", "warm_pkg.sub", "cuda_at_import", "no_such_module_here"]
    write_list(state, names)
    got = run(REPLAY.format(names=names, version="9.9.9"), gated_env(state), [lib])
    rep = got["rep"]
    assert got["before"] == {n: False for n in names}
    assert got["after"] == {"colorsys": True, "warm_pkg": True, "warm_pkg.sub": True, "cuda_at_import": False,
                            "no_such_module_here": False}
    assert rep["listed"] == 5 and rep["imported"] == 3, rep
    assert rep["failed"] == ["cuda_at_import", "no_such_module_here"], rep
    # the module that asked for CUDA failed here; torch's CUDA stays untouched, its init restored
    assert got["cuda"] is False and got["lazy_init_restored"] == "_lazy_init"
    assert rep["gc_frozen"] > 1000 and got["frozen"] > 0.9 * rep["gc_frozen"]  # still frozen
    decode(GateReport, {"state": "parked", "pid": 1, "at": "x", "warm": rep})  # the gate says it as it is


@pytest.mark.parametrize("case", ["other-version", "no-list", "garbled"])
def test_a_list_that_does_not_fit_imports_nothing_and_says_why(tmp_path: Path, case: str) -> None:
    state, lib = tmp_path / "state", make_pkg(tmp_path / "lib")
    if case == "other-version":
        write_list(state, ["warm_pkg"], version="0.1.0")
    elif case == "garbled":
        p = contract.warm_imports_path(state, "engine_core")
        p.parent.mkdir(parents=True)
        p.write_text('{"role": "engine_core"}')
    got = run(REPLAY.format(names=["warm_pkg"], version="9.9.9"), gated_env(state), [lib])
    rep = got["rep"]
    assert rep["imported"] == 0 and got["after"] == {"warm_pkg": False}
    want = {"other-version": "from vLLM 0.1.0, this is 9.9.9", "no-list": "no list yet",
            "garbled": "unreadable"}[case]
    assert want in rep["note"], rep


def test_only_a_gated_generation_asked_for_it_warms_and_only_it_skips_vllms_usage_report(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    assert not warmstart.asked({contract.WARM_VAR: "1"})  # not gated
    assert not warmstart.asked({contract.GATE_VAR: str(gate)})  # gated, warm start off
    env = contract.gate_env({}, gate, 60, warm=True)
    assert warmstart.asked(env) and env[contract.USAGE_STATS_VAR] == "1"
    assert contract.USAGE_STATS_VAR not in contract.gate_env({}, gate, 60, warm=False)
    # the operator's own choice about vLLM's usage report wins
    assert contract.gate_env({contract.USAGE_STATS_VAR: "0"}, gate, 60, warm=True)[contract.USAGE_STATS_VAR] == "0"


def test_the_recorder_hooks_run_once_after_the_wrapped_call_returns() -> None:
    calls: list[str] = []

    class Engine:
        def init(self, x: int) -> int:
            calls.append("init")
            return x + 1

    class Server:
        async def startup(self) -> str:
            calls.append("startup")
            return "up"

    warmstart.after(Engine, "init", lambda: calls.append("recorded-engine"))
    warmstart.after(Engine, "init", lambda: calls.append("twice"))  # wrapped once only
    warmstart.after(Server, "startup", lambda: calls.append("recorded-api"))
    assert Engine().init(1) == 2
    import asyncio

    assert asyncio.run(Server().startup()) == "up"
    assert calls == ["init", "recorded-engine", "startup", "recorded-api"]
