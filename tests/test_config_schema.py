"""The configuration is one frozen value, and the schema's declared constraints refuse a bad value
with one line naming the key, the value and the rule (msgspec's words turned into ours)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from vllm_guard.core import config as C
from vllm_guard.core.config import ConfigError, GuardConfig


def test_the_configuration_and_every_section_are_frozen() -> None:
    cfg = GuardConfig()
    with pytest.raises(AttributeError):
        cfg.server.port = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.server = C.ServerConfig()  # type: ignore[misc]
    for name in C.SECTIONS:
        with pytest.raises(AttributeError):
            setattr(getattr(cfg, name), getattr(cfg, name).__struct_fields__[0], None)


def test_with_value_gives_a_new_value_and_leaves_the_old_one_as_it_was() -> None:
    old = C.load(None)
    new = C.with_value(old, "server", "vllm_args", ["--max-model-len", "512"])
    assert new.server.vllm_args == ("--max-model-len", "512") and old.server.vllm_args == ()
    assert new.explicit == {"server": {"vllm_args"}} and old.explicit == {}
    assert new.recycle is old.recycle  # untouched sections are shared, not copied
    with pytest.raises(ConfigError, match=r"^\[server\] port has value 0: must be >= 1$"):
        C.with_value(old, "server", "port", 0)


@pytest.mark.parametrize("section,table,line", [
    ("server", {"port": 70000}, "[server] port has value 70000: must be <= 65535"),
    ("server", {"port": True}, "[server] port has value True: not an integer"),
    ("server", {"port": None}, "[server] port must be set"),
    ("server", {"max_body_mb": float("nan")}, "[server] max_body_mb has value nan: must be finite"),
    ("server", {"host": "a\nb"}, "[server] host has value 'a\\nb': control characters (newline, tab, ...) are not allowed"),
    ("server", {"vllm_args": "--x"}, "[server] vllm_args has value '--x': not a list of strings"),
    ("server", {"vllm_args": ["--x", 1]}, "[server] vllm_args has value 1: not a string"),
    ("server", {"gpus": ["0", "zero"]}, "[server] gpus has value 'zero': not a GPU index (0, 1, ...) or UUID"),
    ("server", {"recycle_strategy": "warm"}, "[server] recycle_strategy has value 'warm': one of auto, overlap, gated, cold"),
    ("server", {"admin_mode": 0o664}, "[server] admin_mode has value 436: not a mode for the admin socket"),
    ("server", {"header_timeout": "2h"}, "[server] header_timeout has value 7200.0: must be <= 3600"),
    ("recycle", {"idle_fraction": 1}, "[recycle] idle_fraction has value 1.0: must be < 1"),
    ("recycle", {"max_uptime": "3 weeks"}, "[recycle] max_uptime has value '3 weeks': not a duration"),
    ("recycle", {"max_uptime": "400d"}, "[recycle] max_uptime has value '400d': longer than a year"),
    ("soak", {"scenario": "S9"}, "[soak] scenario has value 'S9': one of S1, S2, S3, S4, custom"),
    ("soak", {"rate": 0}, "[soak] rate has value 0.0: must be > 0"),
    ("install", {"user": "Root"}, "[install] user has value 'Root': not a valid system user name"),
    ("install", {"user": "root\n"}, "[install] user has value 'root\\n': not a valid system user name"),
    ("install", {"env": {"A B": "x"}}, "[install] env has value {'A B': 'x'}: a name in it is not a variable name"),
    ("install", {"env": {"A": "x\n"}}, "[install] env has value {'A': 'x\\n'}: control characters"),
    ("install", {"env": {"A": 1}}, "[install] env has value {'A': 1}: not a string"),
    ("install", {"memory_max": "lots"}, "[install] memory_max has value 'lots': use e.g. 64G, 90% or infinity"),
    ("patches", {"disable": ["kv-audit"]}, "[patches] disable has value 'kv-audit': one of kv-block-audit, "),
    ("watchdog", {"kernel": "sometimes"}, "[watchdog] kernel has value 'sometimes': auto, kmsg, journal, off or a file path"),
    ("watchdog", {"intervall": 1}, "[watchdog] intervall is not a known key (known: "),
    ("sever", {}, "[sever] is not a known section (known: server, "),
])
def test_a_refusal_is_one_line_naming_the_key_the_value_and_the_rule(section: str, table: dict[str, Any],
                                                                      line: str) -> None:
    with pytest.raises(ConfigError) as e:
        C.section_from_table(section, table)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_env_strings_read_as_the_declared_types() -> None:
    """The plugin's transport (`parse_kv`): bool words, numbers, `a+b` lists, durations."""
    inject = C.section_from_table("inject", {"block_leak_every": " 4 ", "pretend_amx": "yes",
                                             "host_leak_mb_per_request": "0.5"}, text=True)
    assert (inject.block_leak_every, inject.pretend_amx, inject.host_leak_mb_per_request) == (4, True, 0.5)
    patches = C.section_from_table("patches", {"disable": "attn-isa+ triton-ptxas", "idle_release_after": "2m"},
                                   text=True)
    assert patches.disable == ("attn-isa", "triton-ptxas") and patches.idle_release_after == 120.0
    with pytest.raises(ConfigError, match=r"^\[inject\] block_leak_every has value 'often': not an integer$"):
        C.section_from_table("inject", {"block_leak_every": "often"}, text=True)


def test_the_admin_mode_range_is_exactly_owner_rw_group_anything_others_nothing() -> None:
    for mode in range(0o1000):
        wanted = mode & ~0o770 == 0 and mode & 0o600 == 0o600
        try:
            C.coerce("server", "admin_mode", mode)
            took = True
        except ConfigError:
            took = False
        assert took == wanted, oct(mode)


@pytest.mark.parametrize("name", list(C.SECTIONS))
def test_every_section_survives_its_own_table(name: str) -> None:
    """What `section_table` writes (durations as `Ns`, tuples as lists), msgspec reads back equal."""
    obj = getattr(GuardConfig(), name)
    assert C.section_from_table(name, C.section_table(obj)) == obj
    assert msgspec.structs.asdict(obj).keys() == set(obj.__struct_fields__)
