"""One `guard.toml` for every command: the schema (core/config_schema.py), read and composed here.

Every command that reads the file validates *all* of its sections, so `install`, `serve`,
`watchdog` and `soak` accept and reject exactly the same files. The result is one frozen
`GuardConfig`; a flag on top gives a new one (`with_value`), never an edit in place. Each invalid
setting raises `ConfigError` with one line naming the key and the value; commands turn it into
exit code 2 before anything starts. msgspec checks what the schema declares; this module reads
durations, env strings (the plugin's transport), older keys and the rules across keys.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from . import vllm_api
from .config_schema import (PATCH_IDS, RECYCLE_STRATEGIES, SECTIONS, Duration, InjectConfig, InstallConfig,
                            LedgerConfig, PatchesConfig, ProbeConfig, RecycleConfig, Section, ServerConfig,
                            SoakConfig, WatchdogConfig)
from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = "/etc/vllm-guard/guard.toml"
MAX_DURATION_S = 366 * 86400.0  # a year: longer is a typo, not a setting

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any, key: str = "duration") -> float:
    """Seconds from `90s`, `30m`, `24h`, `1d`, `250ms` or a bare number; finite, 0..1 year."""
    bad = f"{key} has value {value!r}: not a duration (use e.g. 90s, 30m, 24h, 1d)"
    if isinstance(value, bool):
        raise ConfigError(bad)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(bad)
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if not math.isfinite(seconds):
        raise ConfigError(f"{key} has value {value!r}: must be finite")
    if seconds < 0:
        raise ConfigError(f"{key} has value {value!r}: must not be negative")
    if seconds > MAX_DURATION_S:
        raise ConfigError(f"{key} has value {value!r}: longer than a year")
    return seconds


def format_duration(seconds: float) -> str:
    """The inverse for writing TOML back: `90s`, `1209600s`, `0.25s` (never an exponent, which
    `parse_duration` would refuse: `f"{1209600.0:g}"` is `1.2096e+06`)."""
    text = format(decimal.Decimal(repr(float(seconds))), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text}s"


@dataclass(frozen=True)
class GuardConfig:
    """The whole configuration: one value, handed to the launcher and to `decide`'s view."""

    server: ServerConfig = field(default_factory=ServerConfig)
    recycle: RecycleConfig = field(default_factory=RecycleConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    soak: SoakConfig = field(default_factory=SoakConfig)
    inject: InjectConfig = field(default_factory=InjectConfig)
    patches: PatchesConfig = field(default_factory=PatchesConfig)
    install: InstallConfig = field(default_factory=InstallConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    # section -> keys given in the file or on the command line (profiles fill in the rest)
    explicit: typing.Mapping[str, frozenset[str]] = field(default_factory=dict, compare=False, repr=False)
    # keys of an older file read under the key that replaced them (one line each, REPLACED)
    deprecations: tuple[str, ...] = field(default=(), compare=False, repr=False)
    source: str | None = field(default=None, compare=False)  # the file it came from

    @property
    def state_path(self) -> Path:
        return Path(self.server.state_dir)


# -- reading a section: durations and env strings first, then msgspec checks the schema --------
def _unwrap(tp: Any) -> tuple[Any, list[msgspec.Meta]]:
    """The base type under `Annotated` and `| None`, with the constraints declared on the way."""
    metas: list[msgspec.Meta] = []
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            metas += [m for m in tp.__metadata__ if isinstance(m, msgspec.Meta)]
            tp = get_args(tp)[0]
        elif origin in (Union, UnionType):
            tp = next(a for a in get_args(tp) if a is not NoneType)
        else:
            return tp, metas


@functools.cache
def _schema(cls: type[Section]) -> dict[str, Any]:
    """Key -> declared type (constraints kept); resolved once, on first use (not at import)."""
    return {f.name: f.type for f in msgspec.structs.fields(cls)}


@functools.cache
def duration_keys(cls: type[Section]) -> frozenset[str]:
    """The keys of a section that take `90s`, `30m`, ... (`config_schema.Duration`)."""
    return frozenset(k for k, tp in _schema(cls).items()
                     if any((m.extra or {}).get("duration") for m in _unwrap(tp)[1]))


def _section(section: str) -> type[Section]:
    cls = SECTIONS.get(section)
    if cls is None:
        raise ConfigError(f"[{section}] is not a known section (known: {', '.join(SECTIONS)})")
    return cls


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _from_text(tp: Any, value: Any) -> Any:
    """An env string (the plugin's transport, `parse_kv`) as the declared type where it reads as
    one: `yes`/`off` bools, numbers, `a+b` lists; anything else is left for msgspec to refuse."""
    if not isinstance(value, str):
        return value
    base, _ = _unwrap(tp)
    text = value.strip()
    if base is bool and text.lower() in (*_TRUE, *_FALSE):
        return text.lower() in _TRUE
    if base in (int, float):
        try:
            return base(text)
        except ValueError:
            return value
    if get_origin(base) is tuple:
        return tuple(v.strip() for v in value.split("+") if v.strip())
    return value


def _prepare(section: str, cls: type[Section], table: typing.Mapping[str, Any], text: bool) -> dict[str, Any]:
    """The table with unknown keys refused, durations in seconds and every number finite."""
    schema, durations = _schema(cls), duration_keys(cls)
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"[{section}] {key}"
        if key not in schema:
            raise ConfigError(f"{name} is not a known key (known: {', '.join(sorted(schema))})")
        if text:
            value = _from_text(schema[key], value)
        if value is not None and key in durations:
            value = parse_duration(value, name)
        elif type(value) is int and _unwrap(schema[key])[0] is float:
            value = float(value)  # as msgspec would, so a refusal shows the value it judged
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} has value {value!r}: must be finite")
        out[key] = value
    return out


# msgspec's words -> ours: `Expected `int` >= 1 - at `$.port`` -> `[server] port has value 0: must be >= 1`
_AT = re.compile(r"^(?P<what>.*) - at `(?:(?P<in_key>key)` in `)?\$\.(?P<key>\w+)(?P<rest>[^`]*)`$", re.S)
_BOUND = re.compile(r"^Expected `[\w |]+` (?P<op>>=|>|<=|<) (?P<n>\S+)$")
_EXPECTED = {"int": "not an integer", "float": "not a number", "bool": "not a bool (true or false)",
             "str": "not a string", "array": "not a list of strings", "object": 'not a table of NAME = "string"'}


def _refusal(section: str, cls: type[Section], data: dict[str, Any], e: msgspec.ValidationError) -> ConfigError:
    """One line naming the key, the value (the list item or table that failed) and the rule."""
    m = _AT.match(str(e))
    if m is None:  # every check is on a key; keep msgspec's own words if that ever changes
        return ConfigError(f"[{section}] {e}")
    key, rest, what = m["key"], m["rest"], m["what"]
    name, value = f"[{section}] {key}", data.get(key)
    container, _ = _unwrap(_schema(cls)[key])
    tp: Any = _schema(cls)[key]
    if (item := re.fullmatch(r"\[(\d+)\]", rest)) and isinstance(value, (list, tuple)):
        value, tp = value[int(item[1])], get_args(container)[0]
    elif m["in_key"] or rest == "[...]":
        tp = get_args(container)[0 if m["in_key"] else 1]
    base, metas = _unwrap(tp)
    described = [meta.description for meta in metas if meta.description]
    if what.endswith("got `null`"):
        return ConfigError(f"{name} must be set")
    if ", got `" in what:
        expected = what.split("`")[1].removesuffix(" | null")
        reason = _EXPECTED.get(expected, what)
    elif what.startswith("Invalid enum value") and get_origin(base) is Literal:
        numeric = get_origin(tp) in (Union, UnionType) and any(_unwrap(a)[0] is int for a in get_args(tp))
        reason = f"one of {', '.join(get_args(base))}" + (" or a whole number" if numeric else "")
    elif described:
        reason = described[0]
    elif bound := _BOUND.match(what):
        reason = f"must be {bound['op']} {float(bound['n']):g}"
    else:
        reason = what
    return ConfigError(f"{name} has value {value!r}: {reason}")


def section_from_table(section: str, table: typing.Mapping[str, Any], text: bool = False) -> Any:
    """A validated section from a raw table (TOML, or env strings with `text`); ConfigError names
    the key and the value."""
    cls = _section(section)
    data = _prepare(section, cls, table, text)
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        raise _refusal(section, cls, data, e) from e


def coerce(section: str, key: str, value: Any, text: bool = False) -> Any:
    """The typed, range-checked value of `[section] key`; ConfigError naming both otherwise."""
    return getattr(section_from_table(section, {key: value}, text), key)


def with_values(cfg: GuardConfig, section: str, table: typing.Mapping[str, Any]) -> GuardConfig:
    """`cfg` with these keys of one section set, validated and marked explicit (a new value:
    the file loader, CLI flags and the installer's fixed values all go through here)."""
    checked = section_from_table(section, table)
    values = {k: getattr(checked, k) for k in table}
    explicit = {**cfg.explicit, section: cfg.explicit.get(section, frozenset()) | set(table)}
    new = msgspec.structs.replace(getattr(cfg, section), **values)
    return dataclasses.replace(cfg, **{section: new}, explicit=explicit)


def with_value(cfg: GuardConfig, section: str, key: str, value: Any) -> GuardConfig:
    """`cfg` with one key set (see `with_values`)."""
    return with_values(cfg, section, {key: value})


# -- the file ---------------------------------------------------------------------------------
# (section, key) of an older guard.toml -> (section, key) that replaced it, and what it means now
REPLACED: dict[tuple[str, str], tuple[str, str, str]] = {
    ("install", "gpus"): ("server", "gpus", "GPU indexes or UUIDs, one replica per GPU or --tensor-parallel-size "
                                            "group; the runtime sets each replica's CUDA_VISIBLE_DEVICES"),
}
_WARNED: set[str] = set()


def from_data(data: typing.Mapping[str, Any], source: str | None = None) -> GuardConfig:
    """A GuardConfig from parsed TOML; every section is checked, then `validate`."""
    tables: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        _section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"{section} has value {table!r}: expected a [{section}] table")
        tables[section] = dict(table)
    notes = tuple(_move_replaced(tables, s, k, source) for s, k in REPLACED if k in tables.get(s, {}))
    sections = {s: section_from_table(s, t) for s, t in tables.items()}
    explicit = {s: frozenset(t) for s, t in tables.items() if t}
    return validate(GuardConfig(**sections, explicit=explicit, deprecations=notes, source=source))


def _move_replaced(tables: dict[str, dict[str, Any]], section: str, key: str, source: str | None) -> str:
    """An older file's key, moved to the key that replaced it, with one deprecation line on
    stderr (once per process); refused when the file sets the new key too. Returns the line."""
    new_section, new_key, meaning = REPLACED[(section, key)]
    old, new = f"[{section}] {key}", f"[{new_section}] {new_key}"
    value = tables[section].pop(key)
    target = tables.setdefault(new_section, {})
    if new_key in target:
        raise ConfigError(f"{old} has value {value!r}: replaced by {new}, which is set too; remove {old}")
    try:
        target[new_key] = coerce(new_section, new_key, value)
    except ConfigError as e:
        raise ConfigError(str(e).replace(new, old, 1)) from e
    note = f"{old} is deprecated: read as {new} ({meaning}); move it there"
    line = f"vllm-guard: warning: {source + ': ' if source else ''}{note}"
    if line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr)
    return note


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"config file {str(p)!r} does not exist") from e
    except IsADirectoryError as e:
        raise ConfigError(f"config file {str(p)!r} is a directory") from e
    except PermissionError as e:
        raise ConfigError(f"config file {str(p)!r} is not readable by this user") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from e


def load(path: str | Path | None) -> GuardConfig:
    """Read and validate all of `guard.toml`; None gives the defaults."""
    if path is None:
        return GuardConfig()
    return from_data(read_toml(path), str(path))


def validate(cfg: GuardConfig) -> GuardConfig:
    """Cross-key rules of every section; call again after CLI flags are applied."""
    s, r = cfg.server, cfg.recycle
    if r.max_requests_jitter and not r.max_requests:
        raise ConfigError(
            f"[recycle] max_requests_jitter has value {r.max_requests_jitter!r}: needs max_requests > 0")
    if s.backoff_max < s.backoff_initial:
        raise ConfigError(f"[server] backoff_max has value {s.backoff_max!r}: must be >= backoff_initial "
                          f"({s.backoff_initial!r})")
    if s.gpus and "replicas" in cfg.explicit.get("server", set()) and s.replicas > len(s.gpus):
        raise ConfigError(f"[server] replicas has value {s.replicas!r}: more than the {len(s.gpus)} GPUs in "
                          f"[server] gpus {s.gpus!r}")
    if s.max_client_tokens and s.max_request_tokens > s.max_client_tokens:
        raise ConfigError(f"[server] max_client_tokens has value {s.max_client_tokens!r}: less than "
                          f"max_request_tokens ({s.max_request_tokens!r}), so a request allowed alone "
                          "would be refused (429) forever")
    context = vllm_api.context_length(s.vllm_args)
    if not s.max_tokens and s.max_request_tokens and context is not None and context > s.max_request_tokens:
        raise ConfigError(f"[server] max_request_tokens has value {s.max_request_tokens!r}: less than the "
                          f"context (--max-model-len {context}), so a request that does not set max_tokens "
                          "would be refused; raise it to the context at least (0: off)")
    if len(set(s.gpus)) != len(s.gpus):
        raise ConfigError(f"[server] gpus has value {s.gpus!r}: a GPU is listed twice")
    if cfg.install.user == cfg.install.watchdog_user:
        raise ConfigError(f"[install] watchdog_user has value {cfg.install.watchdog_user!r}: must differ from user")
    return cfg


def section_table(obj: Section) -> dict[str, Any]:
    """A section as a TOML-ready table (durations as `Ns`, tuples as lists, None left out)."""
    durations = duration_keys(type(obj))
    out: dict[str, Any] = {}
    for key in obj.__struct_fields__:
        v = getattr(obj, key)
        if v is not None:
            out[key] = format_duration(v) if key in durations else list(v) if isinstance(v, tuple) else v
    return out


def as_dict(cfg: GuardConfig) -> dict[str, Any]:
    """Plain dict (logs)."""
    return {name: msgspec.structs.asdict(getattr(cfg, name)) for name in SECTIONS}


# -- the env transport of [inject] and [patches] to every vLLM process --------------------------
def parse_kv(text: str, section: str) -> dict[str, str]:
    """`a=1,b=2` -> {'a': '1', 'b': '2'}; lists inside a value use `+` (disable=a+b)."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"[{section}] entry {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def format_kv(table: typing.Mapping[str, Any]) -> str:
    """The inverse of `parse_kv` for validated tables."""
    parts = []
    for key, value in table.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = "+".join(value)
        parts.append(f"{key}={value}")
    return ",".join(parts)


__all__ = [
    "DEFAULT_CONFIG", "PATCH_IDS", "RECYCLE_STRATEGIES", "ConfigError", "Duration", "GuardConfig", "InjectConfig",
    "InstallConfig", "LedgerConfig", "PatchesConfig", "ProbeConfig", "RecycleConfig", "SECTIONS", "Section",
    "ServerConfig", "SoakConfig", "WatchdogConfig", "as_dict", "coerce", "duration_keys", "format_duration",
    "format_kv", "from_data", "load", "parse_duration", "parse_kv", "read_toml", "section_from_table",
    "section_table", "tomllib", "validate", "with_value", "with_values",
]
