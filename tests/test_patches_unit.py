"""The patches plugin without a server: settings, child env, reports, shape checks, `patches list`.

Shape checks run against the real installed vLLM 0.32.0 source and against copies of its
modules/classes with a real attribute renamed; no vLLM behaviour is mocked. The runtime's side
of the contract (child env, settings from env, report files) is `vllm_guard.core.plugin`; the
plugin writes what it reads.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_guard.core import plugin as contract
from vllm_guard.core.config import ConfigError, GuardConfig, from_data
from vllm_guard.core.protocol import PatchProcessReport, decode
from vllm_guard.patches import defs, registry, report
from vllm_guard.patches.idle import IdleReleaser, release, rss_bytes
from vllm_guard.patches.inject import touched_buffer

ROOT = Path(__file__).resolve().parent.parent
VLLM_ROOT = registry.vllm_root()
needs_vllm = pytest.mark.skipif(VLLM_ROOT is None, reason="vllm not installed")


# --- settings -----------------------------------------------------------------------------

def test_inject_env_string_parses_and_validates() -> None:
    inject, _ = contract.settings_from_env({"VLLM_GUARD_INJECT": "host_leak_mb_per_request=0.15, block_leak_every=4"})
    assert inject.host_leak_mb_per_request == 0.15
    assert inject.block_leak_every == 4
    assert inject.active == {"host_leak_mb_per_request": 0.15, "block_leak_every": 4}


@pytest.mark.parametrize("table, needle", [
    ({"host_leak_mb": 1}, "[inject] host_leak_mb is not a known key"),
    ({"block_leak_every": 1.5}, "[inject] block_leak_every has value 1.5"),
    ({"hang_after_requests": -1}, "[inject] hang_after_requests has value -1"),
    ({"crash_after_requests": "soon"}, "[inject] crash_after_requests has value 'soon'"),
])
def test_bad_inject_key_names_key_and_value(table: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(needle)):
        from_data({"inject": table})
    env = {"VLLM_GUARD_INJECT": ",".join(f"{k}={v}" for k, v in table.items())}
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(needle.split(" has value")[0])):
        contract.settings_from_env(env)  # the same rule in the vLLM process


@pytest.mark.parametrize("table, needle", [
    ({"idle_release": 5}, "[patches] idle_release is not a known key"),
    ({"disable": ["kv-audit"]}, "[patches] disable has value 'kv-audit'"),
    ({"idle_release_after": "soon"}, "[patches] idle_release_after has value 'soon'"),
    ({"enabled": "maybe"}, "[patches] enabled has value 'maybe'"),
])
def test_bad_patches_key_names_key_and_value(table: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(needle)):
        from_data({"patches": table})


def test_patch_settings_round_trip_through_env() -> None:
    table = {"disable": ["kv-block-audit", "idle-release"], "idle_release_after": "2s", "malloc_arena_max": 2}
    env = contract.child_env({}, from_data({"patches": table}), [])
    _, got = contract.settings_from_env(env)
    assert got.disable == ("kv-block-audit", "idle-release")
    assert got.idle_release_after == 2.0 and got.malloc_arena_max == 2
    assert not got.wants("kv-block-audit") and got.wants("allocator-settings")


# --- child env ----------------------------------------------------------------------------

def test_vllm_plugins_unset_stays_unset_and_user_list_is_kept() -> None:
    cfg = GuardConfig()
    assert "VLLM_PLUGINS" not in contract.child_env({}, cfg, [])
    assert contract.child_env({"VLLM_PLUGINS": "theirs"}, cfg, [])["VLLM_PLUGINS"] == "theirs,vllm_guard"
    assert contract.child_env({"VLLM_PLUGINS": "a,vllm_guard"}, cfg, [])["VLLM_PLUGINS"] == "a,vllm_guard"


@pytest.mark.parametrize("env, args, expect", [
    ({}, [], "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, [], "max_split_size_mb:64"),
    ({}, ["--enable-sleep-mode"], None),
    ({}, ["--tensor-parallel-size", "2"], None),
    ({}, ["-tp=2", "--disable-custom-all-reduce"], "expandable_segments:True"),
    ({}, ["--tensor-parallel-size", "1"], "expandable_segments:True"),
])
def test_allocator_setting_respects_user_and_incompatible_modes(env: dict, args: list, expect: str | None) -> None:
    out = contract.child_env(dict(env), GuardConfig(), args)
    assert out.get("PYTORCH_CUDA_ALLOC_CONF") == expect
    assert out[contract.NOTE_VAR]


def test_malloc_arena_and_inject_from_config_unless_env_has_them() -> None:
    cfg = from_data({"patches": {"malloc_arena_max": 2}, "inject": {"host_leak_mb_per_request": 0.15}})
    out = contract.child_env({}, cfg, [])
    assert out["MALLOC_ARENA_MAX"] == "2"
    assert contract.settings_from_env(out)[0].host_leak_mb_per_request == 0.15
    out = contract.child_env({"VLLM_GUARD_INJECT": "block_leak_every=3", "MALLOC_ARENA_MAX": "4"}, cfg, [])
    assert out["VLLM_GUARD_INJECT"] == "block_leak_every=3" and out["MALLOC_ARENA_MAX"] == "4"


def test_plugin_modules_import_without_vllm_or_torch() -> None:
    """Loading the plugin costs a vLLM process nothing until register() looks at vLLM's classes."""
    code = ("import sys; import vllm_guard.patches, vllm_guard.patches.cli, vllm_guard.patches.plugin, "
            "vllm_guard.patches.report, vllm_guard.patches.registry, vllm_guard.patches.defs; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the report channel -------------------------------------------------------------------

def test_the_plugin_writes_where_the_runtime_reads(tmp_path: Path) -> None:
    """Channel (the plugin's writer) and core.plugin (the runtime's reader) share one layout."""
    ch = report.Channel.from_env({contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "3"})
    ch.report({"process": "engine_core", "pid": os.getpid(),
               "patches": {"kv-block-audit": {"state": "applied", "reason": "x"}}})
    ch.event({"event": "orphans_reclaimed", "block_ids": [4, 5]})
    ch.event({"event": "idle_release", "released_bytes": 4096})
    ch.inject({"event": "block_leak", "block_ids": [4, 5]})
    (contract.gen_dir(tmp_path, 3) / contract.EVENTS).open("a").write('{"torn": ')  # a killed writer
    states = contract.read_states(tmp_path, 3)
    mine = states[str(os.getpid())]
    assert mine.process == "engine_core" and mine.alive is True
    assert mine.events is not None
    assert mine.events.orphan_blocks_reclaimed == 2 and mine.events.idle_released_bytes == 4096
    assert [e["event"] for e in contract.events(tmp_path, 3)] == ["orphans_reclaimed", "idle_release"]
    assert [(e["event"], e["pid"]) for e in contract.injected(tmp_path, 3)] == [("block_leak", os.getpid())]
    assert contract.read_states(tmp_path, 2) == {}
    assert not list(contract.gen_dir(tmp_path, 3).glob(".*tmp"))  # atomic: no temp files left


@pytest.mark.parametrize("env", [{}, {contract.GENERATION_VAR: "1"}])
def test_without_a_state_dir_the_channel_writes_nothing(tmp_path: Path, env: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain `vllm serve` with the plugin installed: no runtime, no files anywhere."""
    monkeypatch.chdir(tmp_path)
    ch = report.Channel.from_env(env)
    ch.report({"process": "api_server", "pid": 1})
    ch.event({"event": "idle_release"})
    assert ch.dir is None and list(tmp_path.iterdir()) == []


def test_a_generation_that_is_not_a_number_reports_as_generation_0(tmp_path: Path) -> None:
    ch = report.Channel.from_env({contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "x"})
    assert ch.dir == contract.gen_dir(tmp_path, 0)


# --- shapes and `patches list` --------------------------------------------------------------

@needs_vllm
def test_patches_list_json_equals_committed_table() -> None:
    version = registry.tree_version(VLLM_ROOT)
    committed = ROOT / "docs" / "patches" / f"vllm-{version}.json"
    r = subprocess.run([sys.executable, "-m", "vllm_guard.cli", "patches", "list", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    listed.pop("attention_isa", None)  # this CPU's probe verdict: not part of the version's table
    assert listed == json.loads(committed.read_text())
    rows = {p["id"]: p for p in listed["patches"]}
    assert all(p["state"] == "applies" for k, p in rows.items() if k != "block-ids-drain")
    # 0.32.0 carries vLLM's own fix (#44490): the drain is skipped, and says why.
    assert rows["block-ids-drain"]["state"] == "skipped"
    assert "carries the upstream fix" in rows["block-ids-drain"]["reason"]


def _copy_tree(dst: Path) -> Path:
    """The modules our targets live in, copied from the installed vLLM (plus _version.py)."""
    root = dst / "vllm"
    files = {"_version.py"} | {registry.module_file(VLLM_ROOT, t.module).relative_to(VLLM_ROOT).as_posix()
                               for d in defs.ALL for t in d.targets}
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(VLLM_ROOT / rel, root / rel)
    (root / "v1").mkdir(exist_ok=True)
    return root


@needs_vllm
def test_renamed_attribute_in_a_copy_of_the_tree_skips_only_its_patches(tmp_path: Path) -> None:
    from vllm_guard.patches.cli import table

    root = _copy_tree(tmp_path)
    assert [p["state"] for p in table(root)["patches"] if p["id"] != "block-ids-drain"] == ["applies"] * (len(defs.ALL) - 1)
    f = root / "v1" / "core" / "single_type_kv_cache_manager.py"
    f.write_text(f.read_text().replace("req_to_blocks", "blocks_by_request"))
    registry._parse.cache_clear()
    rows = {p["id"]: p for p in table(root)["patches"]}
    assert rows["kv-block-audit"]["state"] == "skipped"
    assert "SingleTypeKVCacheManager has no attribute(s) req_to_blocks" in rows["kv-block-audit"]["reason"]
    assert rows["idle-release"]["state"] == "applies"


@needs_vllm
def test_a_tree_without_the_upstream_fix_gets_the_block_ids_drain(tmp_path: Path) -> None:
    """The drain is gated by shape: names that came with vLLM's own fix mean "not needed"."""
    from vllm_guard.patches.cli import table

    root = _copy_tree(tmp_path)
    for rel, names in (("v1/core/sched/scheduler.py", ("_get_new_block_ids_to_zero",)),
                       ("v1/core/single_type_kv_cache_manager.py", ("records_new_block_ids", "_record_new_block_ids"))):
        f = root / rel
        text = f.read_text()
        for n in names:
            text = text.replace(n, n.strip("_") + "_renamed_for_test")
        f.write_text(text)
    registry._parse.cache_clear()
    rows = {p["id"]: p for p in table(root)["patches"]}
    assert rows["block-ids-drain"]["state"] == "applies", rows["block-ids-drain"]["reason"]


@needs_vllm
def test_out_of_range_version_is_skipped_with_reason(tmp_path: Path) -> None:
    from vllm_guard.patches.cli import table

    root = _copy_tree(tmp_path)
    (root / "_version.py").write_text("__version__ = version = '0.41.0'\n")
    rows = table(root)["patches"]
    assert all(r["state"] == "skipped" and "outside [0.20, 0.40)" in r["reason"] for r in rows)


@needs_vllm
def test_live_check_on_a_copy_of_the_class_with_a_renamed_method() -> None:
    import importlib

    mod = importlib.import_module("vllm.v1.core.block_pool")
    real = mod.BlockPool
    body = {k: v for k, v in vars(real).items() if k not in ("__dict__", "__weakref__")}
    body["release_blocks"] = body.pop("free_blocks")
    copy = type("BlockPool", real.__bases__, body)
    t = registry.Anchor("vllm.v1.core.block_pool", "BlockPool", "free_blocks", ("ordered_blocks",))
    assert registry.live_check(t) is None
    mod.BlockPool = copy
    try:
        assert registry.live_check(t) == "BlockPool.free_blocks not found"
    finally:
        mod.BlockPool = real


def test_version_ranges() -> None:
    assert registry.in_range("0.32.0+cpu", "0.20", "0.40")
    assert registry.in_range("0.25.1", "0.20", "0.40")
    assert not registry.in_range("0.40.0", "0.20", "0.40")
    assert not registry.in_range("dev", "0.20", "0.40")


# --- idle-release and the leak buffer -------------------------------------------------------

def test_idle_releaser_runs_once_per_idle_period_never_while_busy(tmp_path: Path) -> None:
    epoch = [0]
    busy = [False]
    ch = report.Channel(str(tmp_path), 1)
    t = IdleReleaser(0.5, lambda: epoch[0], lambda: busy[0], ch, "engine_core", True, lambda: None)
    t.start()

    def wait_releases(n: int) -> None:
        end = time.monotonic() + 10
        while t.releases < n and time.monotonic() < end:
            time.sleep(0.05)
        assert t.releases == n

    try:
        wait_releases(1)  # idle period 1
        time.sleep(1.0)
        assert t.releases == 1  # once per period, not every 0.5 s
        busy[0] = True  # a long request in flight: never released
        time.sleep(1.2)
        assert t.releases == 1
        busy[0] = False
        end = time.monotonic() + 1.5  # busy stretch of short requests: the epoch keeps moving
        while time.monotonic() < end:
            epoch[0] += 1
            time.sleep(0.05)
        assert t.releases == 1
        wait_releases(2)  # idle period 2
    finally:
        t.stop()
    events = contract.events(tmp_path, 1)
    assert [e["event"] for e in events] == ["idle_release", "idle_release"]
    assert all("rss_before" in e and e["released_bytes"] >= 0 for e in events)


def test_release_returns_freed_host_memory() -> None:
    junk = [bytearray(b"x" * 1000) for _ in range(60_000)]  # ~60 MB of small objects in a cycle
    junk.append(junk)  # type: ignore[arg-type]
    del junk
    out = release(trim=True)
    assert out["gc_collected"] > 0
    assert out["released_bytes"] == max(0, out["rss_before"] - out["rss_after"])


def test_touched_buffer_moves_rss() -> None:
    gc.collect()
    before = rss_bytes()
    keep = [touched_buffer(1 << 20) for _ in range(32)]
    grown = rss_bytes() - before
    assert 28 << 20 <= grown <= 40 << 20, grown
    assert len(keep) == 32


REGISTER = """
import json, multiprocessing, sys
multiprocessing.current_process().name = sys.argv[1]
import vllm_guard.patches as p
p.register(); p.register()
from vllm_guard.patches.plugin import _STATE
print(json.dumps(_STATE["plugin"].report()))
"""


@pytest.mark.parametrize("process_name, role", [
    ("MainProcess", "api_server"), ("EngineCore_DP0", "engine_core"), ("VllmWorker-0", "worker"),
])
def test_register_reports_a_valid_patch_process_report_per_role(tmp_path: Path, process_name: str,
                                                                role: str) -> None:
    """register() in a fresh interpreter named like vLLM's processes: idempotent, role detected,
    every patch applied to the real vLLM classes, and its report() decodes as the runtime's
    PatchProcessReport (from stdout and from the file the runtime reads)."""
    env = {**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "1",
           contract.PATCHES_VAR: "idle_release_after=60",
           contract.INJECT_VAR: "block_leak_every=4,host_leak_mb_per_request=0.5"}
    r = subprocess.run([sys.executable, "-c", REGISTER, process_name], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    out = decode(PatchProcessReport, json.loads(r.stdout.strip().splitlines()[-1]))
    assert out.process == role and out.pid != os.getpid() and out.generation == "1"
    (rep,) = contract.read_states(tmp_path, 1).values()
    assert rep.model_dump(exclude={"alive"}) == out.model_dump(exclude={"alive"})
    states = {k: v.state for k, v in rep.patches.items()}
    assert set(states) == {d.id for d in defs.ALL}
    assert states["idle-release"] == ("applied" if VLLM_ROOT else "skipped")
    assert states["allocator-settings"] == "skipped"  # no allocator settings in this env
    if role == "engine_core":
        assert states["kv-block-audit"] == states["fault-injection"] == ("applied" if VLLM_ROOT else "skipped")
        if VLLM_ROOT:
            assert rep.details["fault-injection"]["spec"] == {"block_leak_every": 4, "host_leak_mb_per_request": 0.5}
            assert rep.details["kv-block-audit"]["runs"] == 0
        assert rep.inject == {"block_leak_every": 4.0, "host_leak_mb_per_request": 0.5}
        assert states["block-ids-drain"] == "skipped"  # 0.32.0 carries vLLM's own fix, or no vLLM
    else:
        assert rep.patches["kv-block-audit"].reason == "not in this process (runs in engine_core)"
        assert rep.patches["block-ids-drain"].reason == "not in this process (runs in engine_core)"
        assert rep.patches["fault-injection"].state == "skipped"
    if role == "api_server":
        assert states["add-request-abort"] == ("applied" if VLLM_ROOT else "skipped")
        assert rep.patches["triton-ptxas"].reason == "not in this process (runs in engine_core, worker)"
    else:  # vLLM's modules brought torch in (its CPU build here): nothing to pin
        assert rep.patches["triton-ptxas"].reason == (
            "not a CUDA build of torch: no Triton kernels for NVIDIA GPUs" if VLLM_ROOT
            else "torch is not imported in this process (vLLM imports it before its plugins)")
    if VLLM_ROOT and role != "engine_core":
        assert rep.details["idle-release"]["after_s"] == 60


def test_bad_settings_in_child_env_are_reported_not_raised(tmp_path: Path) -> None:
    code = "import vllm_guard.patches as p; p.register()"
    env = {**os.environ, contract.STATE_DIR_VAR: str(tmp_path), contract.GENERATION_VAR: "1",
           contract.INJECT_VAR: "block_leak_every=often"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "[inject] block_leak_every has value 'often': not an integer" in r.stderr  # logged
    (rep,) = contract.read_states(tmp_path, 1).values()  # a valid PatchProcessReport
    assert rep.error == "[inject] block_leak_every has value 'often': not an integer"
    assert {p.state for p in rep.patches.values()} == {"failed"}
    assert "block_leak_every has value 'often'" in rep.patches["fault-injection"].reason


def test_an_unwritable_state_dir_never_reaches_vllm(tmp_path: Path) -> None:
    """register() with a state dir it cannot create: logged, the process carries on."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = "import vllm_guard.patches as p; p.register(); print('served')"
    for extra in ({contract.INJECT_VAR: "block_leak_every=often"}, {contract.PATCHES_VAR: "idle_release_after=60"}):
        env = {**os.environ, contract.STATE_DIR_VAR: str(blocker / "state"), contract.GENERATION_VAR: "1", **extra}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0 and r.stdout.strip() == "served", r.stderr[-2000:]
        assert "could not write its patch report" in r.stderr


def test_listener_failure_is_swallowed_unless_marked_fatal() -> None:
    """A guard's bug never reaches vLLM; the injector's CUDA OOM must (it kills EngineCore like a
    real leak's OOM), so plain vLLM under the cap fails the way the seed describes."""
    from vllm_guard.patches.engine import FATAL, EngineHooks

    hooks_ = EngineHooks()
    calls: list[str] = []

    def buggy(*_: object) -> None:
        calls.append("buggy")
        raise ValueError("a guard bug")

    def oom(*_: object) -> None:
        calls.append("oom")
        e = MemoryError("CUDA out of memory (injected)")
        setattr(e, FATAL, True)
        raise e

    hooks_._call([buggy, buggy], None)
    assert calls == ["buggy", "buggy"]
    with pytest.raises(MemoryError, match="injected"):
        hooks_._call([buggy, oom, buggy], None)
    assert calls == ["buggy", "buggy", "buggy", "oom"]
