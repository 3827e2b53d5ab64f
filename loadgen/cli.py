"""`vllm-guard soak`: argument parsing and wiring, nothing more.

Settings come from `[soak]` of `--config` (core.config.SoakConfig, the file validated whole),
then the flags, through the same coercion. Heavy modules (aiohttp, numpy, psutil, pydantic)
are imported inside the handler, so `vllm-guard --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Coroutine, TypeVar

from vllm_guard.core.errors import ConfigError, ProtocolError, UsageError

from .scenarios import PRESETS

if TYPE_CHECKING:
    from vllm_guard.core.config import SoakConfig

    from .params import SoakParams
    from .store import SoakStore, StoredRun

Handler = Callable[[argparse.Namespace, list[str]], int]
T = TypeVar("T")

# flags that override [soak] keys of the same name
SOAK_FLAGS = ("url", "scenario", "duration", "rate", "burstiness", "concurrency", "db", "seed", "mode", "timeout",
              "prompt_tokens", "output_tokens", "model", "state_dir", "sample_interval")


# flags that shape the load: a resumed run keeps its stored ones, so --resume refuses them
LOAD_FLAGS = ("scenario", "duration", "rate", "burstiness", "mode", "burst_period", "burst_duty", "concurrency",
              "prompt_tokens", "output_tokens", "requests", "seed", "tokenizer", "model")


def add_commands(sub: Any) -> dict[str, Handler]:
    s = sub.add_parser("soak", help="load against a server (open loop at --rate, or closed loop); every result "
                                    "streamed to the ledger",
                       description="Soak a server: an open loop (--rate R: arrivals on a seeded schedule, "
                                   "whether or not earlier requests have finished) or a closed loop (no --rate: "
                                   "--concurrency requests in flight, the next sent when one ends). Both stop "
                                   "sending at --duration. Each result is written to the ledger as it ends; a "
                                   "killed soak continues with --resume or --resume-or-start.")
    s.add_argument("--config", help="guard.toml: its [soak] section gives defaults for these flags")
    s.add_argument("--url", help="server URL (default: the guard of the state dir)")
    s.add_argument("--scenario", choices=[*PRESETS, "custom"], default=None,
                   help="prompt/output tokens and concurrency: S1 512/256/1, S2 8192/1024/4, S3 65536/512/1, "
                        "S4 2048/512/32, scaled to the model's context; custom needs the token flags (default S1)")
    s.add_argument("--duration", default=None,
                   help="run time, e.g. 60s, 30m, 24h (default 10m); no request is sent after it, in either loop")
    s.add_argument("--rate", type=float, default=None,
                   help="open loop: mean requests per second (> 0). Without it: a closed loop at --concurrency")
    s.add_argument("--burstiness", type=float, default=None,
                   help="open loop: gamma shape of the gaps between arrivals; 1 = Poisson (default 1)")
    s.add_argument("--mode", choices=["steady", "burst"], default=None,
                   help="open loop: burst packs the same mean rate into on-windows (default steady)")
    s.add_argument("--burst-period", default=None, help="burst mode: period of the on-window (default 60s)")
    s.add_argument("--burst-duty", type=float, default=None,
                   help="burst mode: share of each period that sends, in (0, 1] (default 0.25)")
    s.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: requests kept in flight; open loop: a cap on them (default: the preset's)")
    s.add_argument("--prompt-tokens", type=int, default=None, help="prompt length in tokens (default: the preset's)")
    s.add_argument("--output-tokens", type=int, default=None, help="output length in tokens (default: the preset's)")
    s.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    s.add_argument("--fixed-span", action="store_true", default=None,
                   help="with --requests N: scale arrivals so the N-th is sent at N/rate (as vllm bench serve)")
    s.add_argument("--seed", type=int, default=None, help="seed of the schedule and the prompts (default 0)")
    s.add_argument("--tokenizer", default=None,
                   help="send prompts as text (these token ids decoded with this tokenizer), so the server "
                        "tokenizes them as it does real traffic and `vllm bench serve`'s; default: token ids")
    s.add_argument("--timeout", default=None, help="per-request timeout (default 10m)")
    s.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    s.add_argument("--db", default=None, help="ledger file to write (default: the state dir's ledger.sqlite)")
    s.add_argument("--state-dir", default=None,
                   help="the guard's state dir: its memory readings are sampled, and it gives the default "
                        "--db and --url (default: $VLLM_GUARD_STATE_DIR, [server] state_dir of --config or "
                        "of the installed /etc/vllm-guard/guard.toml, ./.state)")
    s.add_argument("--sample-interval", default=None, help="status polling interval (default 2s)")
    again = s.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue the last unfinished run in the ledger with its stored settings "
                            "(exit 2 when there is none)")
    again.add_argument("--resume-or-start", action="store_true",
                       help="continue the last unfinished run that has these load settings, or start a new "
                            "one (what a service that may be restarted runs)")
    s.add_argument("--run-id", type=int, default=None, help="with --resume: which run")
    s.add_argument("--no-progress", action="store_true", help="no progress bar or periodic progress lines")
    s.add_argument("--summary-json", default=None, help="also write the end-of-run summary (JSON) to this file")
    return {"soak": cmd_soak}


def soak_config(args: argparse.Namespace) -> SoakConfig:
    """[soak] of --config (the whole file validated), then the flags given, one coercion."""
    from vllm_guard.core.config import load, validate, with_value

    cfg = load(args.config)
    for key in SOAK_FLAGS:
        v = getattr(args, key)
        if v is not None:
            try:
                cfg = with_value(cfg, "soak", key, v)
            except ConfigError as e:  # name the flag the operator typed, not the file's key
                hint = " (leave --rate out for a closed loop at --concurrency)" if key == "rate" else ""
                raise UsageError(str(e).replace(f"[soak] {key}", "--" + key.replace("_", "-"), 1) + hint) from e
    return validate(cfg).soak


def state_dir(soak: SoakConfig, config: str | None) -> tuple[str, bool]:
    """(state dir, named): named when --state-dir, [soak] state_dir, $VLLM_GUARD_STATE_DIR or
    --config's [server] state_dir gave it; otherwise it is the installed guard's or ./.state."""
    from vllm_guard.core.paths import resolve_state_dir

    found = resolve_state_dir(soak.state_dir, config)
    return found[0], found != resolve_state_dir(None, None, env={})


def ledger_path(db: str | None, sdir: str, named: bool) -> str:
    from vllm_guard.core.ledger import LEDGER_NAME

    if db:
        return db
    if not named and not Path(sdir).is_dir():
        raise UsageError("no --db and no guard state dir (--state-dir, $VLLM_GUARD_STATE_DIR, [server] state_dir): "
                         "say where the ledger is")
    return str(Path(sdir) / LEDGER_NAME)


def writable_file(flag: str, path: str | None) -> None:
    """A file argument whose directory does not exist fails before anything runs."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise UsageError(f"{flag} has value {path!r}: no directory {str(Path(path).parent)!r}")


async def _server_info(url: str) -> tuple[str, int | None]:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                data = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise UsageError(f"--url has value {url!r}: cannot list models ({type(e).__name__}: {e})") from e
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise UsageError(f"--url has value {url!r}: the server lists no model at /v1/models")
    max_len = models[0].get("max_model_len")
    return str(models[0]["id"]), int(max_len) if isinstance(max_len, int) else None


def _status_check(sdir: str) -> int | None:
    """The guard's public port, or None when no guard answers there. A status that does not
    decode (runtime and soak of different versions) is a usage error, not zeros later."""
    from vllm_guard.core.admin import AdminError, fetch_status

    from .sampler import is_protocol_error

    try:
        return asyncio.run(fetch_status(sdir)).port
    except AdminError as e:
        if is_protocol_error(e):
            raise UsageError(f"the guard's status at {sdir} does not match this soak ({e}): "
                             "the runtime and the soak are different versions") from e
        return None


def build_params(args: argparse.Namespace, c: SoakConfig) -> tuple[SoakParams, str, str]:
    """(parameters of a new run, ledger path, scaling note)."""
    from vllm_guard.core.admin import socket_path
    from vllm_guard.core.config import parse_duration

    from .params import SoakParams
    from .scenarios import scenario

    sdir, named = state_dir(c, args.config)
    sample = named or socket_path(sdir).exists()  # an unnamed state dir only where a guard runs
    port = None
    if sample or not c.url:
        try:
            port = _status_check(sdir)
        except UsageError as e:
            if named or not c.url:
                raise
            print(f"note: not sampling the guard at {sdir}: {e}", file=sys.stderr)
            sample = False
    url = c.url
    if not url:
        if port is None:
            raise UsageError(f"no --url, and no guard answers at {socket_path(sdir)} to find it from")
        url = f"http://127.0.0.1:{port}"
    elif sample and port is None:
        print(f"note: no guard answers at {socket_path(sdir)} yet: memory samples start when it does",
              file=sys.stderr)
    url = url.rstrip("/")
    model, max_len = asyncio.run(_server_info(url))
    shape = scenario(c.scenario or "S1", max_len, c.prompt_tokens, c.output_tokens, c.concurrency)
    rate = float(c.rate or math.inf)
    if math.isinf(rate) and not shape.concurrency:
        raise UsageError("--rate not given and no --concurrency: an unbounded closed loop would flood the server")
    mode = c.mode or "steady"
    if args.fixed_span and (not args.requests or math.isinf(rate) or mode != "steady"):
        raise UsageError("--fixed-span needs --requests, --rate and steady mode")
    if math.isinf(rate) and (mode != "steady" or c.burstiness is not None):
        raise UsageError("--mode burst and --burstiness shape an open loop's arrivals: give --rate too")
    duty = 0.25 if args.burst_duty is None else args.burst_duty
    if not (math.isfinite(duty) and 0 < duty <= 1):
        raise UsageError(f"--burst-duty has value {duty!r}: must be in (0, 1]")
    if args.requests is not None and args.requests < 1:
        raise ConfigError(f"--requests has value {args.requests!r}: must be >= 1")
    params = SoakParams(
        url=url, model=c.model or model, max_model_len=max_len, scenario=shape.name,
        prompt_tokens=shape.prompt_tokens, output_tokens=shape.output_tokens, concurrency=shape.concurrency,
        rate=rate, burstiness=float(c.burstiness or 1.0), mode=mode,
        burst_period_s=parse_duration(args.burst_period or "60s", "--burst-period"), burst_duty=duty,
        seed=c.seed or 0, duration_s=float(c.duration or 600.0), timeout_s=float(c.timeout or 600.0),
        max_requests=args.requests, state_dir=sdir if sample else None,
        span_requests=args.requests if args.fixed_span and args.requests else 0,
        sample_interval_s=float(c.sample_interval or 2.0), tokenizer=args.tokenizer,
    )
    if args.tokenizer:
        from .runner import load_tokenizer

        try:
            load_tokenizer(args.tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure to load is a usage error
            raise UsageError(f"--tokenizer {args.tokenizer}: cannot load it ({type(e).__name__}: {e})") from e
    return params, ledger_path(c.db, sdir, named), shape.note


def _run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop where installed (it comes with vLLM): a lower send lag at high rates."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _open_store(db: str) -> SoakStore:
    from vllm_guard.core import ledger
    from vllm_guard.core.ledger import LedgerError

    from .store import SoakStore

    try:
        f = ledger.db_path(db)
        if f.is_file() and f.stat().st_size > 0:  # never add our tables to someone else's file (empty: new)
            ledger.refuse_newer(f, ledger.file_version(f))  # first: it leaves no -wal/-shm beside a newer file
            ledger.open_readonly(f).close()
        return SoakStore(db)
    except LedgerError as e:
        raise UsageError(f"--db: {e}") from e


def _stored_params(run: StoredRun) -> SoakParams:
    from .params import SoakParams

    try:
        return SoakParams.from_json(run.params)
    except ProtocolError as e:
        raise UsageError(f"--resume: run {run.id} was written by another version of the soak: {e}") from e


def _resume_target(store: SoakStore, db: str, run_id: int | None) -> tuple[StoredRun, SoakParams]:
    """--resume: the run to continue, or one line and exit 2."""
    run = store.stored_run(run_id)
    if run is None:
        raise UsageError(f"--resume: no unfinished run in {db}" + (f" with id {run_id}" if run_id else "")
                         + " (--resume-or-start starts one when there is none)")
    return run, _stored_params(run)


def _matching_run(store: SoakStore, params: SoakParams) -> tuple[StoredRun, SoakParams] | None:
    """--resume-or-start: the newest unfinished run with the same load, if any. Its target and
    sampling follow today's flags (the server may have moved)."""
    for run in store.unfinished_runs():
        try:
            stored = _stored_params(run)
        except UsageError:
            continue  # written by another version: never continued, a new run starts
        if stored.same_load(params):
            return run, dataclasses.replace(stored, url=params.url, state_dir=params.state_dir,
                                            sample_interval_s=params.sample_interval_s,
                                            timeout_s=params.timeout_s)
    return None


def cmd_soak(args: argparse.Namespace, _: list[str]) -> int:
    from .runner import Soak, new_token, summary

    writable_file("--summary-json", args.summary_json)
    c = soak_config(args)
    if args.resume:
        given = [f"--{k.replace('_', '-')}" for k in LOAD_FLAGS if getattr(args, k) is not None]
        given += ["--fixed-span"] if args.fixed_span else []
        if given:
            raise UsageError(f"--resume continues a run with its stored load settings: drop {', '.join(given)} "
                             "(or use --resume-or-start)")
        sdir, named = state_dir(c, args.config)
        db = ledger_path(c.db, sdir, named)
        if not Path(db).exists():
            raise UsageError(f"--db has value {db!r}: no ledger to resume")
        note = ""
    else:
        params, db, note = build_params(args, c)
    store = _open_store(db)
    try:
        found = (_resume_target(store, db, args.run_id) if args.resume
                 else _matching_run(store, params) if args.resume_or_start else None)
    except UsageError:
        store.close()
        raise
    if found is not None:
        run, params = found
        token, run_id = run.token, run.id
        print(f"soak: resuming run {run_id}: {params.describe()}", file=sys.stderr)
    else:
        token = new_token()
        run_id = store.create_run(token, params, note)
        print(f"soak: run {run_id}: {params.describe()}", file=sys.stderr)
        if note:
            print(f"note: {note}", file=sys.stderr)
    # The ledger writer thread must not hold the GIL for the default 5 ms while a send is due.
    sys.setswitchinterval(0.0005)
    soak = Soak(store, run_id, token, params, progress=not args.no_progress)
    try:
        status = _run_loop(soak.run())
    finally:
        store.close()
    out = summary(soak, status)
    if soak.behind:
        print(f"note: {soak.behind} requests scheduled before the end were never sent: the concurrency cap "
              f"({params.concurrency}) held them back (the server could not keep up with {params.rate:g} req/s)",
              file=sys.stderr)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0 if status == "done" else 130
