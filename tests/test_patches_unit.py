"""The patches plugin without a server: settings, child env, reports, shape checks, `patches list`.

Shape checks run against the real installed vLLM 0.32.0 source and against copies of its
modules/classes with a real attribute renamed; no vLLM behaviour is mocked.
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

from vllm_guard.patches import defs, hooks, registry, report, spec
from vllm_guard.patches.idle import IdleReleaser, release, rss_bytes
from vllm_guard.patches.inject import touched_buffer
from vllm_guard.runtime.config import ConfigError, GuardConfig

ROOT = Path(__file__).resolve().parent.parent
VLLM_ROOT = registry.vllm_root()
needs_vllm = pytest.mark.skipif(VLLM_ROOT is None, reason="vllm not installed")


# --- settings -----------------------------------------------------------------------------

def test_inject_env_string_parses_and_validates() -> None:
    s = spec.from_env({"VLLM_GUARD_INJECT": "host_leak_mb_per_request=0.15, block_leak_every=4"})
    assert s.inject.host_leak_mb_per_request == 0.15
    assert s.inject.block_leak_every == 4
    assert s.inject.active == {"host_leak_mb_per_request": 0.15, "block_leak_every": 4}


@pytest.mark.parametrize("table, needle", [
    ({"host_leak_mb": 1}, "[inject] host_leak_mb is not a known key"),
    ({"block_leak_every": 1.5}, "[inject] block_leak_every has value 1.5"),
    ({"hang_after_requests": -1}, "[inject] hang_after_requests has value -1"),
    ({"crash_after_requests": "soon"}, "[inject] crash_after_requests has value 'soon'"),
])
def test_bad_inject_key_names_key_and_value(table: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(needle)):
        hooks.validate(GuardConfig(inject=table))


@pytest.mark.parametrize("table, needle", [
    ({"idle_release": 5}, "[patches] idle_release is not a known key"),
    ({"disable": ["kv-audit"]}, "[patches] disable has value 'kv-audit'"),
    ({"idle_release_after": "soon"}, "[patches] idle_release_after has value 'soon'"),
    ({"enabled": "maybe"}, "[patches] enabled has value 'maybe'"),
])
def test_bad_patches_key_names_key_and_value(table: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=r"^" + __import__("re").escape(needle)):
        hooks.validate(GuardConfig(patches=table))


def test_patch_settings_round_trip_through_env() -> None:
    table = {"disable": ["kv-block-audit", "idle-release"], "idle_release_after": "2s", "malloc_arena_max": 2}
    env = hooks.child_env({}, GuardConfig(patches=table), [])
    got = spec.from_env(env).patches
    assert got.disable == ("kv-block-audit", "idle-release")
    assert got.idle_release_after == 2.0 and got.malloc_arena_max == 2
    assert not got.wants("kv-block-audit") and got.wants("allocator-settings")


# --- child env ----------------------------------------------------------------------------

def test_vllm_plugins_unset_stays_unset_and_user_list_is_kept() -> None:
    cfg = GuardConfig()
    assert "VLLM_PLUGINS" not in hooks.child_env({}, cfg, [])
    assert hooks.child_env({"VLLM_PLUGINS": "theirs"}, cfg, [])["VLLM_PLUGINS"] == "theirs,vllm_guard"
    assert hooks.child_env({"VLLM_PLUGINS": "a,vllm_guard"}, cfg, [])["VLLM_PLUGINS"] == "a,vllm_guard"


@pytest.mark.parametrize("env, args, expect", [
    ({}, [], "expandable_segments:True"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, [], "max_split_size_mb:64"),
    ({}, ["--enable-sleep-mode"], None),
    ({}, ["--tensor-parallel-size", "2"], None),
    ({}, ["-tp=2", "--disable-custom-all-reduce"], "expandable_segments:True"),
    ({}, ["--tensor-parallel-size", "1"], "expandable_segments:True"),
])
def test_allocator_setting_respects_user_and_incompatible_modes(env: dict, args: list, expect: str | None) -> None:
    out = hooks.child_env(dict(env), GuardConfig(), args)
    assert out.get("PYTORCH_CUDA_ALLOC_CONF") == expect
    assert out[hooks.NOTE_VAR]


def test_malloc_arena_and_inject_from_config_unless_env_has_them() -> None:
    cfg = GuardConfig(patches={"malloc_arena_max": 2}, inject={"host_leak_mb_per_request": 0.15})
    out = hooks.child_env({}, cfg, [])
    assert out["MALLOC_ARENA_MAX"] == "2"
    assert spec.from_env(out).inject.host_leak_mb_per_request == 0.15
    out = hooks.child_env({"VLLM_GUARD_INJECT": "block_leak_every=3", "MALLOC_ARENA_MAX": "4"}, cfg, [])
    assert out["VLLM_GUARD_INJECT"] == "block_leak_every=3" and out["MALLOC_ARENA_MAX"] == "4"


def test_hooks_import_without_vllm_or_torch() -> None:
    code = ("import sys; import vllm_guard.patches.hooks, vllm_guard.patches.cli; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --- the report channel -------------------------------------------------------------------

def test_reports_and_events_are_read_per_generation(tmp_path: Path) -> None:
    ch = report.Channel(str(tmp_path), "3")
    ch.report({"process": "engine_core", "patches": {"kv-block-audit": {"state": "applied", "reason": "x"}}})
    ch.event({"event": "orphans_reclaimed", "block_ids": [4, 5]})
    ch.event({"event": "idle_release", "released_bytes": 4096})
    (report.gen_dir(tmp_path, 3) / report.EVENTS).open("a").write('{"torn": ')  # a killed writer
    states = hooks.read_states(tmp_path, 3)
    mine = states[str(os.getpid())]
    assert mine["process"] == "engine_core" and mine["alive"] is True
    assert mine["events"]["orphan_blocks_reclaimed"] == 2
    assert mine["events"]["idle_released_bytes"] == 4096
    assert hooks.read_states(tmp_path, 2) == {}
    assert not list(report.gen_dir(tmp_path, 3).glob(".*tmp"))  # atomic: no temp files left


# --- shapes and `patches list` --------------------------------------------------------------

@needs_vllm
def test_patches_list_json_equals_committed_table() -> None:
    version = registry.tree_version(VLLM_ROOT)
    committed = ROOT / "docs" / "patches" / f"vllm-{version}.json"
    r = subprocess.run([sys.executable, "-m", "vllm_guard.runtime", "patches", "list", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(committed.read_text())
    rows = {p["id"]: p for p in json.loads(r.stdout)["patches"]}
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
    t = registry.Target("vllm.v1.core.block_pool", "BlockPool", "free_blocks", ("ordered_blocks",))
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
    ch = report.Channel(str(tmp_path), "1")
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
    events = report.read_jsonl(report.gen_dir(tmp_path, 1) / report.EVENTS)
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


def test_plugin_register_is_idempotent_and_role_detected(tmp_path: Path) -> None:
    """register() in a fresh interpreter (API-server role): twice, one report, no vLLM engine."""
    code = ("import vllm_guard.patches as p; p.register(); p.register(); "
            "from vllm_guard.patches.plugin import _STATE; print(_STATE['plugin'].role)")
    env = {**os.environ, "VLLM_GUARD_STATE_DIR": str(tmp_path), "VLLM_GUARD_GENERATION": "1",
           "VLLM_GUARD_PATCHES": "idle_release_after=60"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "api_server"
    states = hooks.read_states(tmp_path, 1)
    (rep,) = states.values()
    assert rep["process"] == "api_server"
    p = rep["patches"]
    assert p["idle-release"]["state"] == ("applied" if VLLM_ROOT else "skipped")
    assert p["kv-block-audit"] == {"state": "skipped", "reason": "not in this process (runs in engine_core)"}
    assert p["add-request-abort"]["state"] == ("applied" if VLLM_ROOT else "skipped")
    assert p["block-ids-drain"] == {"state": "skipped", "reason": "not in this process (runs in engine_core)"}
    assert p["fault-injection"]["state"] == "skipped"


def test_bad_settings_in_child_env_are_reported_not_raised(tmp_path: Path) -> None:
    code = "import vllm_guard.patches as p; p.register()"
    env = {**os.environ, "VLLM_GUARD_STATE_DIR": str(tmp_path), "VLLM_GUARD_GENERATION": "1",
           "VLLM_GUARD_INJECT": "block_leak_every=often"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    (rep,) = hooks.read_states(tmp_path, 1).values()
    assert rep["patches"]["fault-injection"]["state"] == "failed"
    assert "block_leak_every has value 'often'" in rep["patches"]["fault-injection"]["reason"]



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
