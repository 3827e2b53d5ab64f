"""`vllm-guard reload` and SIGHUP without vLLM: the configuration composed again as `serve`
composed it (file, then flags), the one-line refusal that names the key, restart-only keys
refused whole, the keys that changed, a stable hash, a standby of the old configuration replaced,
and the command's answer (applied through a recycle, unchanged, refused) in milliseconds."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from vllm_guard.cli import build_parser
from vllm_guard.core.config import GuardConfig, with_value, with_values
from vllm_guard.core.ledger import EndClass
from vllm_guard.core.protocol import Command, CommandRequest, RuntimeState
from vllm_guard.runtime import reload as R
from vllm_guard.runtime.cli import composer
from vllm_guard.runtime.commands import Commands
from vllm_guard.runtime.replica.decide import decide
from vllm_guard.runtime.replica.machine import Machine, State
from vllm_guard.runtime.replica.view import (
    Abandon, Facts, GenPhase, GenView, RecycleCmd, ReplicaView, Tick,
)

BASE = """
[server]
model = "{model}"
port = 8100
drain_timeout = "30s"
vllm_args = ["--enforce-eager", "--max-model-len", "512"]

[recycle]
max_requests = 100
"""


def compose_for(tmp_path: Path, text: str, *flags: str) -> tuple[Path, Callable[[], tuple[GuardConfig, str]]]:
    """guard.toml with `text` and the composer `serve --config it *flags` keeps."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    cfg = tmp_path / "guard.toml"
    cfg.write_text(text.format(model=model))
    argv = ["serve", "--config", str(cfg), *flags]
    vllm: list[str] = []
    if "--" in argv:
        argv, vllm = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser()[0].parse_args(argv)
    return cfg, composer(args, vllm, sys.executable)


def test_a_reload_composes_the_file_again_with_the_same_flags_on_top(tmp_path: Path) -> None:
    path, compose = compose_for(tmp_path, BASE, "--port", "9123", "--max-requests", "7", "--", "--max-num-seqs", "4")
    cfg, model = compose()
    assert cfg.server.port == 9123 and cfg.recycle.max_requests == 7  # flags win over the file
    assert cfg.server.vllm_args == ("--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "4")
    assert model == cfg.server.model and cfg.source == str(path)
    path.write_text(path.read_text().replace('"512"', '"256"').replace("port = 8100", "port = 8200")
                    .replace("max_requests = 100", "max_requests = 50"))
    again, _ = compose()
    assert again.server.vllm_args == ("--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "4")
    assert again.server.port == 9123 and again.recycle.max_requests == 7  # the flags again, not the file
    plan = R.plan_reload(cfg, compose)
    assert plan.verdict == "apply" and plan.changed == ("[server] vllm_args",), plan
    assert plan.cfg is not None and plan.cfg.server.vllm_args[2] == "256"


@pytest.mark.parametrize("edit, key", [
    (lambda t: t + "\nbogus_key = 1\n", "[recycle] bogus_key"),
    (lambda t: t.replace('drain_timeout = "30s"', 'drain_timeout = "soon"'), "[server] drain_timeout"),
    (lambda t: t.replace("max_requests = 100", "max_requests = -3"), "[recycle] max_requests"),
    (lambda t: t.replace('"--max-model-len", "512"', '"--port", "1"'), "'--port'"),
    (lambda t: t + "\n[nonsense]\n", "[nonsense]"),
    (lambda t: t.replace("[recycle]", "[recycle"), "not valid TOML"),
])
def test_a_bad_file_is_refused_in_one_line_that_names_the_key(tmp_path: Path, edit: Callable[[str], str],
                                                              key: str) -> None:
    path, compose = compose_for(tmp_path, BASE)
    cfg, _ = compose()
    path.write_text(edit(path.read_text()))
    plan = R.plan_reload(cfg, compose)
    assert plan.verdict == "refused" and key in plan.detail and "\n" not in plan.detail, plan.detail
    assert plan.cfg is None and plan.config_hash == R.config_hash(cfg)  # the running one, untouched


@pytest.mark.parametrize("line, key", [
    ("port = 8100", "port = 8101"), ("port = 8100", "port = 8100\nhost = \"0.0.0.0\""),
    ("port = 8100", "port = 8100\nstate_dir = \"/tmp/elsewhere\""), ("port = 8100", "port = 8100\nreplicas = 2"),
    ("port = 8100", "port = 8100\nmetrics_port = 9999"), ("port = 8100", "port = 8100\nadmin_mode = 0o600"),
])
def test_a_key_only_a_restart_applies_refuses_the_whole_reload(tmp_path: Path, line: str, key: str) -> None:
    path, compose = compose_for(tmp_path, BASE)
    cfg, _ = compose()
    # a key that changes live beside it: nothing of the file is applied either
    path.write_text(path.read_text().replace(line, key).replace('"512"', '"256"'))
    plan = R.plan_reload(cfg, compose)
    name = key.split("\n")[-1].split(" =")[0]
    assert plan.verdict == "refused" and f"[server] {name}" in plan.detail, plan.detail
    assert "systemctl restart" in plan.detail and "\n" not in plan.detail and plan.cfg is None


def test_a_restart_only_key_set_by_a_flag_is_not_the_files_to_change(tmp_path: Path) -> None:
    path, compose = compose_for(tmp_path, BASE, "--port", "9123")
    cfg, _ = compose()
    path.write_text(path.read_text().replace("port = 8100", "port = 8101"))
    assert R.plan_reload(cfg, compose).verdict == "unchanged"


def test_nothing_changed_is_said_and_not_recycled(tmp_path: Path) -> None:
    path, compose = compose_for(tmp_path, BASE)
    cfg, _ = compose()
    path.write_text("# a comment\n" + path.read_text() + "\n[watchdog]\ninterval = \"2s\"\n")
    plan = R.plan_reload(cfg, compose)
    assert plan.verdict == "unchanged" and plan.cfg is None, plan
    assert plan.ignored == ("[watchdog] interval",) and "[watchdog] interval" in plan.detail


def test_changed_keys_name_section_and_key_in_schema_order() -> None:
    a = GuardConfig()
    b = with_values(a, "server", {"model": "/m", "vllm_args": ["--max-num-seqs", "8"]})
    b = with_value(b, "probe", "interval", 3.0)
    assert R.changed_keys(a, b) == ["[server] model", "[server] vllm_args", "[probe] interval"]
    assert R.changed_keys(a, GuardConfig()) == []


def test_the_hash_is_short_stable_and_reads_only_the_runtimes_sections(tmp_path: Path) -> None:
    _, compose = compose_for(tmp_path, BASE)
    one, two = compose()[0], compose()[0]
    h = R.config_hash(one)
    assert len(h) == R.HASH_CHARS and h == R.config_hash(two) and int(h, 16) >= 0
    reordered = tmp_path / "r"
    reordered.mkdir()
    text = "[recycle]\nmax_requests = 100\n\n" + BASE.split("[recycle]")[0]
    _, again = compose_for(reordered, text)
    cfg3 = with_value(again()[0], "server", "model", one.server.model)  # the model dir's path differs between the two folders
    assert R.config_hash(cfg3) == h  # the order of sections and keys does not count
    other = with_value(one, "watchdog", "interval", 9.0)
    assert R.config_hash(other) == h  # nor do the watchdog's settings
    args = with_value(one, "server", "vllm_args", [*one.server.vllm_args, "--max-num-seqs", "8"])
    assert R.config_hash(args) != h


# -- decide: a standby launched with the old configuration is not the one a reload recycles to ----
def test_a_standby_of_the_old_configuration_is_replaced() -> None:
    cur = GenView(number=1, phase=GenPhase.SERVING, spawned_at=0.0, ready_at=10.0, config="aaa")
    nxt = GenView(number=2, phase=GenPhase.BOOTING, spawned_at=20.0, gated=True, beside=True, standby=True,
                  gate="parked", config="aaa")
    m = Machine(state=State.STANDBY, since=30.0, entered=True)
    same = decide(ReplicaView(machine=m, facts=Facts(cfg=GuardConfig(), config_hash="aaa"), current=cur,
                              successor=nxt), Tick(), 40.0)
    assert not any(isinstance(e, Abandon) for e in same.effects) and same.machine.state is State.STANDBY
    new = decide(ReplicaView(machine=m, facts=Facts(cfg=GuardConfig(), config_hash="bbb"), current=cur,
                             successor=nxt), Tick(), 40.0)
    assert [e for e in new.effects if isinstance(e, Abandon)] and new.machine.state is State.SERVING
    assert "bbb" in next(e.why for e in new.effects if isinstance(e, Abandon))


# -- the command: refused, unchanged, applied through a recycle ---------------------------------
class FakeDriver:
    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.events: list[Any] = []

    def view(self, facts: Facts) -> ReplicaView:
        state = State.SERVING if self.accept else State.STARTING
        cur = GenView(number=1, phase=GenPhase.SERVING if self.accept else GenPhase.BOOTING, spawned_at=0.0,
                      ready_at=10.0 if self.accept else None)
        return ReplicaView(machine=Machine(state=state, since=0.0, entered=True), facts=facts, current=cur)

    async def tick(self, facts: Callable[[], Facts]) -> None:
        self.events.append(Tick())

    async def handle(self, event: Any, facts: Callable[[], Facts]) -> Any:
        self.events.append(event)
        return decide(self.view(facts()), event, 100.0)


class FakeRuntime:
    def __init__(self, plan: R.ReloadPlan, accept: bool = True) -> None:
        self.plan, self.drivers = plan, [FakeDriver(accept)]
        self.hold: str | None = None
        self.applied: list[R.ReloadPlan] = []
        self.notes: list[tuple[str, str, str]] = []

    state = RuntimeState.SERVING
    generation = 1

    def facts(self, d: Any) -> Facts:
        return Facts(cfg=GuardConfig())

    def wake(self) -> None: ...

    def begin_stop(self, second: bool) -> None: ...

    async def set_hold(self, reason: str) -> str:
        return ""

    async def release(self) -> str | None:
        return None

    async def plan_reload(self) -> R.ReloadPlan:
        return self.plan

    def apply_config(self, plan: R.ReloadPlan) -> None:
        self.applied.append(plan)

    def note_reload(self, reason: str, outcome: str, detail: str) -> None:
        self.notes.append((reason, outcome, detail))


def _reload(rt: FakeRuntime) -> Any:
    req = CommandRequest(command=Command.RELOAD, reason="sighup")
    return asyncio.run(Commands(rt).reload(req))  # type: ignore[arg-type]


def test_a_refused_reload_is_a_config_error_and_applies_nothing() -> None:
    rt = FakeRuntime(R.ReloadPlan("refused", "[server] bogus is not a known key (known: ...)", "abc"))
    reply = _reload(rt)
    assert not reply.accepted and reply.config_error and "[server] bogus" in reply.detail
    assert not rt.applied and rt.drivers[0].events == [] and rt.notes[0][:2] == ("sighup", "refused")


def test_an_unchanged_reload_says_so_and_recycles_nothing() -> None:
    rt = FakeRuntime(R.ReloadPlan("unchanged", "configuration abc unchanged: nothing to do", "abc"))
    reply = _reload(rt)
    assert reply.accepted and "unchanged" in reply.detail and not rt.applied and rt.drivers[0].events == []


def test_an_applied_reload_swaps_the_config_then_recycles_with_reason_reload() -> None:
    plan = R.ReloadPlan("apply", "configuration abc -> def: [server] vllm_args", "def", ("[server] vllm_args",),
                        cfg=GuardConfig(), model="m")
    rt = FakeRuntime(plan)
    reply = _reload(rt)
    assert reply.accepted and not reply.config_error and rt.applied == [plan], reply
    tick, recycle = rt.drivers[0].events
    assert isinstance(tick, Tick) and isinstance(recycle, RecycleCmd)
    assert recycle.reason == "reload" and recycle.cls is EndClass.SCHEDULED
    assert "[server] vllm_args" in reply.detail and rt.notes == [("sighup", "applied", plan.detail)]


def test_a_replica_that_cannot_recycle_now_refuses_the_reload_whole() -> None:
    plan = R.ReloadPlan("apply", "configuration abc -> def: [server] model", "def", ("[server] model",),
                        cfg=GuardConfig(), model="m")
    rt = FakeRuntime(plan, accept=False)
    reply = _reload(rt)
    assert not reply.accepted and not reply.config_error and "not applied" in reply.detail
    assert not rt.applied and rt.drivers[0].events == []


def test_status_text_names_the_configuration_and_a_refused_reload() -> None:
    from vllm_guard.core.protocol import ConfigStatus, ReloadStatus
    from vllm_guard.runtime.status.fmt import _config

    applied = ConfigStatus(hash="0123456789ab", source="/etc/vllm-guard/guard.toml", applied_at="2026-12-05T10:00:00Z",
                           changed=["[server] vllm_args"])
    assert _config(applied) == ["config      0123456789ab from /etc/vllm-guard/guard.toml, reloaded "
                                "2026-12-05T10:00:00Z: [server] vllm_args"]
    refused = ConfigStatus(hash="0123456789ab", last_reload=ReloadStatus(
        at="2026-12-05T10:01:00Z", reason="sighup", outcome="refused", detail="[server] bogus is not a known key"))
    lines = _config(refused)
    assert lines[0] == "config      0123456789ab (flags and defaults)"
    assert "last reload (sighup) refused" in lines[1] and "[server] bogus" in lines[1]


def test_a_runtime_started_without_a_file_says_there_is_none_to_re_read(tmp_path: Path) -> None:
    args = build_parser()[0].parse_args(["serve", "--model", str(tmp_path), "--port", "9001"])
    compose = composer(args, ["--enforce-eager"], sys.executable)
    cfg, model = compose()
    plan = R.plan_reload(cfg, compose)
    assert plan.verdict == "unchanged" and "without --config" in plan.detail and model == str(tmp_path)


# -- the supervisor's swap: one value, and every holder that copied part of it at start ----------
def test_apply_config_swaps_the_one_value_and_what_copied_it(tmp_path: Path) -> None:
    import json
    import sqlite3

    from vllm_guard.runtime.supervisor import Supervisor

    async def go() -> None:
        old = with_value(GuardConfig(), "server", "state_dir", str(tmp_path))
        sup = Supervisor(old, "m")
        try:
            assert sup.status().config.hash == R.config_hash(old)  # type: ignore[union-attr]
            new = with_values(old, "server", {"migration_limit": 7, "max_n": 3, "queue_size": 5,
                                              "failure_window": 42.0, "retry_after": 11})
            plan = R.ReloadPlan("apply", "x", R.config_hash(new), tuple(R.changed_keys(old, new)), cfg=new, model="m")
            sup.apply_config(plan)
            p = sup.proxy
            assert sup.cfg is new and p.cfg is new.server and p.dispatch.cfg is new.server
            assert p.policy.num_retries == 7 and p.dispatch.policy is p.policy and p.upstream.policy is p.policy
            assert p.admission.limits.max_n == 3 and p.queue.queue_size == 5 and p.gate.retry_after == 11
            assert sup.books.failure_window == 42.0
            conf = sup.status().config
            assert conf is not None and conf.hash == plan.config_hash != R.config_hash(old)
            assert conf.changed == ["[server] queue_size", "[server] migration_limit", "[server] retry_after",
                                    "[server] failure_window", "[server] max_n"] and conf.applied_at
            sup.note_reload("sighup", "refused", "[server] port has value 1: ...")
            assert sup.status().config.last_reload.outcome == "refused"  # type: ignore[union-attr]
        finally:
            await asyncio.to_thread(sup.ledger.close)

    asyncio.run(go())
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    (value,) = db.execute("SELECT value FROM meta WHERE key = 'runtime.last_reload'").fetchone()
    assert json.loads(value)["outcome"] == "refused" and "[server] port" in json.loads(value)["detail"]


def test_the_proxy_loads_its_tokenizer_again_only_when_the_model_or_its_arguments_changed(tmp_path: Path) -> None:
    from vllm_guard.core.config import ServerConfig
    from vllm_guard.runtime.frontdoor.proxy import Proxy

    async def go() -> None:
        p = Proxy(ServerConfig(model=str(tmp_path / "a")), on_limit=lambda t: None, on_error=lambda t: None)
        p.tokenizer, p.tokenizer_why = object(), ""  # as if loaded at start
        p.configure(ServerConfig(model=str(tmp_path / "a"), migration_limit=1))
        assert p.tokenizer is not None and not p._tasks  # same tokenizer: kept
        p.configure(ServerConfig(model=str(tmp_path / "b")))
        assert p.tokenizer is None and p.facts.tokenizer == str(tmp_path / "b") and len(p._tasks) == 1
        await p._tasks[0]  # no such model dir: resumption off, and it says why
        assert p.tokenizer is None and "loading" not in p.tokenizer_why

    asyncio.run(go())
