"""`vllm-guard soak` and `vllm-guard report`: argument parsing and wiring, nothing more."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

import aiohttp

from vllm_guard.runtime import admin
from vllm_guard.runtime.config import ConfigError, load, parse_duration

from .scenarios import PRESETS, scenario, validate_section

Handler = Callable[[argparse.Namespace, list[str]], int]


def add_commands(sub: Any) -> dict[str, Handler]:
    s = sub.add_parser("soak", help="open-loop soak against a server; results streamed to the ledger")
    s.add_argument("--config", help="guard.toml ([soak] section)")
    s.add_argument("--url", help="server URL (default: the guard of --state-dir)")
    s.add_argument("--scenario", choices=[*PRESETS, "custom"], default=None)
    s.add_argument("--duration", default=None, help="run time, e.g. 30m, 24h (default 10m)")
    s.add_argument("--rate", type=float, default=None, help="mean requests/s (default: closed loop at --concurrency)")
    s.add_argument("--burstiness", type=float, default=None, help="gamma shape; 1 = Poisson")
    s.add_argument("--mode", choices=["steady", "burst"], default=None)
    s.add_argument("--burst-period", default="60s")
    s.add_argument("--burst-duty", type=float, default=0.25)
    s.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    s.add_argument("--prompt-tokens", type=int, default=None)
    s.add_argument("--output-tokens", type=int, default=None)
    s.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    s.add_argument("--fixed-span", action="store_true",
                   help="with --requests N: scale arrivals so the N-th is sent at N/rate (as vllm bench serve)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--tokenizer", default=None,
                   help="send prompts as text (these token ids decoded with this tokenizer), so the server "
                        "tokenizes them as it does real traffic and `vllm bench serve`'s; default: token ids")
    s.add_argument("--timeout", default=None, help="per-request timeout (default 10m)")
    s.add_argument("--model", default=None, help="model name (default: the server's first)")
    s.add_argument("--db", default=None, help="ledger (default: the state dir's)")
    s.add_argument("--state-dir", default=None, help="the guard's state dir: memory samples, default --db/--url")
    s.add_argument("--sample-interval", default=None, help="status polling interval (default 2s)")
    s.add_argument("--resume", action="store_true", help="continue the last unfinished run in --db")
    s.add_argument("--run-id", type=int, default=None, help="with --resume: which run")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--summary-json", default=None, help="write the end-of-run summary here")

    r = sub.add_parser("report", help="MTBF, leaks, thermals, latency and errors from a ledger")
    r.add_argument("--db", default=None, help="ledger file or state dir (default: the state dir's)")
    r.add_argument("--state-dir", default=None)
    r.add_argument("--format", choices=["text", "json", "html"], default="text")
    r.add_argument("--out", default=None, help="file to write (default stdout)")
    r.add_argument("--compare", nargs=2, metavar=("A.db", "B.db"), default=None)
    r.add_argument("--run-id", type=int, default=None, help="soak run for latency/errors (default: all)")
    r.add_argument("--confidence", type=float, default=0.90)
    return {"soak": cmd_soak, "report": cmd_report}


def _usage(msg: str) -> Exception:
    from vllm_guard.runtime.cli import UsageError

    return UsageError(msg)


def _state_dir(arg: str | None) -> str | None:
    d = arg or os.environ.get("VLLM_GUARD_STATE_DIR")
    if d:
        return d
    return ".state" if admin.socket_path(".state").exists() else None


def _default_db(db: str | None, state_dir: str | None) -> str:
    if db:
        return db
    if state_dir:
        return str(Path(state_dir) / "ledger.sqlite")
    raise _usage("no --db and no --state-dir: say where the ledger is")


async def _server_info(url: str) -> tuple[str, int | None]:
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
                data = await r.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise _usage(f"--url has value {url!r}: cannot list models ({type(e).__name__}: {e})") from e
    models = data.get("data") or []
    if not models:
        raise _usage(f"--url has value {url!r}: the server lists no model")
    return models[0]["id"], models[0].get("max_model_len")


def _merged(args: argparse.Namespace) -> dict[str, Any]:
    """[soak] from guard.toml, then CLI flags."""
    cfg = validate_section(load(args.config).soak) if args.config else {}
    for key in ("url", "scenario", "duration", "rate", "burstiness", "concurrency", "db", "seed", "mode",
                "timeout", "prompt_tokens", "output_tokens", "model", "state_dir", "sample_interval"):
        v = getattr(args, key)
        if v is not None:
            cfg[key] = v
    return cfg


def build_params(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    c = _merged(args)
    state_dir = _state_dir(c.get("state_dir"))
    url = c.get("url")
    if not url:
        if not state_dir:
            raise _usage("no --url and no guard state dir to find it from")
        try:
            st = asyncio.run(admin.request(state_dir, "GET", "/status"))
        except admin.AdminError as e:
            raise _usage(f"no --url and {e}") from e
        url = f"http://127.0.0.1:{st['port']}"
    url = url.rstrip("/")
    model, max_len = asyncio.run(_server_info(url))
    shape = scenario(c.get("scenario") or "S1", max_len, c.get("prompt_tokens"), c.get("output_tokens"),
                     c.get("concurrency"))
    rate = float(c.get("rate") or math.inf)
    if math.isinf(rate) and not shape.concurrency:
        raise _usage("--rate not given and no --concurrency: an unbounded closed loop would flood the server")
    for name, v in (("rate", rate), ("burstiness", c.get("burstiness", 1.0)), ("concurrency", shape.concurrency or 1)):
        if not v > 0:
            raise ConfigError(f"{name} has value {v!r}: must be > 0")
    if args.fixed_span and (not args.requests or math.isinf(rate) or (c.get("mode") or "steady") != "steady"):
        raise _usage("--fixed-span needs --requests, --rate and steady mode")
    if not 0 < args.burst_duty <= 1:
        raise ConfigError(f"--burst-duty has value {args.burst_duty!r}: must be in (0, 1]")
    params = {
        "url": url, "model": c.get("model") or model, "max_model_len": max_len, "scenario": shape.name,
        "prompt_tokens": shape.prompt_tokens, "output_tokens": shape.output_tokens,
        "concurrency": shape.concurrency, "rate": rate, "burstiness": float(c.get("burstiness", 1.0)),
        "mode": c.get("mode") or "steady", "burst_period_s": parse_duration(args.burst_period, "--burst-period"),
        "burst_duty": args.burst_duty, "seed": int(c.get("seed", 0)),
        "duration_s": parse_duration(c.get("duration", "10m"), "--duration"),
        "timeout_s": parse_duration(c.get("timeout", "10m"), "--timeout"),
        "max_requests": args.requests, "state_dir": state_dir,
        "span_requests": args.requests if args.fixed_span and args.requests else 0,
        "sample_interval_s": parse_duration(c.get("sample_interval", "2s"), "--sample-interval"),
        "tokenizer": args.tokenizer,
    }
    if args.tokenizer:
        from .runner import load_tokenizer

        try:
            load_tokenizer(args.tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure to load is a usage error
            raise _usage(f"--tokenizer {args.tokenizer}: cannot load it ({type(e).__name__}: {e})") from e
    return params, _default_db(c.get("db"), state_dir), shape.note  # type: ignore[return-value]


def _run_loop(coro: Any) -> Any:
    """uvloop where installed (it comes with vLLM): a lower send lag at high rates."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def cmd_soak(args: argparse.Namespace, _: list[str]) -> int:
    from .runner import Soak, new_token, summary
    from .store import SoakStore

    if args.resume:
        db = _default_db(args.db, _state_dir(args.state_dir))
        if not Path(db).exists():
            raise _usage(f"--db has value {db!r}: no ledger to resume")
        store = SoakStore(db)
        row = store.run(args.run_id) if args.run_id else store.last_unfinished_run()
        if row is None:
            store.close()
            raise _usage(f"--resume: no unfinished run in {db}" + (f" with id {args.run_id}" if args.run_id else ""))
        params, token, run_id = json.loads(row["params"]), row["token"], int(row["id"])
        params["rate"] = float(params["rate"])
        print(f"resuming run {run_id} ({params['scenario']}, seed {params['seed']})", file=sys.stderr)
    else:
        params, db, note = build_params(args)
        store = SoakStore(db)
        token = new_token()
        run_id = store.create_run(token, params, note)
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
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0 if status == "done" else 130


def cmd_report(args: argparse.Namespace, _: list[str]) -> int:
    from . import report

    if not 0 < args.confidence < 1:
        raise ConfigError(f"--confidence has value {args.confidence!r}: must be in (0, 1)")
    if args.compare:
        for p in args.compare:
            if not Path(p).exists():
                raise _usage(f"--compare: no ledger at {p!r}")
        text = report.render_compare(args.compare, args.format, args.confidence)
    else:
        db = _default_db(args.db, _state_dir(args.state_dir))
        if not Path(db).exists():
            raise _usage(f"--db has value {db!r}: no ledger there")
        text = report.render(db, args.format, args.confidence, args.run_id)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
