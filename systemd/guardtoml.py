"""The guard.toml that `vllm-guard install` writes: every section, every key, what each one does.

Keys the operator set (in the base file or with install's flags) are written as settings; every
other key is written commented out with its default. The file documents itself, and keys left
commented keep following the defaults of the installed release (and the watchdog's GPU
profiles, which only fill in keys nobody set). `HELP` holds one comment per key of every section
of `core.config`; a test checks that none is missing.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from vllm_guard.core import config as C
from vllm_guard.core.config import GuardConfig

WIDTH = 100

SECTION_HELP: dict[str, str] = {
    "server": "Where the guard listens, where it keeps its state, how it starts and stops vLLM.",
    "recycle": "When a vLLM generation is replaced by a fresh one (drained first: no request is lost). "
               "0 turns a trigger off. `vllm-guard install` turns the memory-growth triggers on; "
               "request-count and uptime recycling stay off unless asked for (--max-requests, --max-uptime).",
    "probe": "The runtime's 1-token completion that tells a hung engine from a busy one.",
    "watchdog": "The separate watchdog (vllm-guard-watchdog.service): memory-drift forecasts, thermals, "
                "OOM, hangs and Xid errors, acted on through the runtime's admin socket. Keys left "
                "commented follow the GPU profile picked from the GPU's name.",
    "soak": "Defaults for `vllm-guard soak --config` (flags win); unset keys use the command's defaults.",
    "inject": "Fault injection for tests: leaks, hangs and crashes inside vLLM. Keep every key at 0 in "
              "production.",
    "patches": "The vLLM plugin's fixes, applied in every vLLM process (`vllm-guard patches list` shows "
               "what applies to the installed vLLM).",
    "ledger": "What the runtime keeps in its ledger of the traffic it served: per-minute latency "
              "histograms and token counts for the ledger's life, per-request rows for a while.",
    "install": "How `vllm-guard install` renders the systemd units. Re-run `vllm-guard install` after "
               "changing these.",
}

HELP: dict[str, dict[str, str]] = {
    "server": {
        "model": "local model directory (pinned: the unit runs with HF_HUB_OFFLINE=1); "
                 "empty: the embedded tiny model, whose text is noise",
        "host": "address the public proxy listens on",
        "port": "public port of the proxy (clients connect here)",
        "state_dir": "ledger, logs, admin socket and hold file (the unit's StateDirectory)",
        "backend_host": "address each vLLM generation listens on, behind the proxy",
        "python": "interpreter that runs vLLM; empty: the runtime's own",
        "backend_nice": "vLLM's processes this many nice levels below the runtime, which keeps its CPU on a saturated box; 0: the same",
        "vllm_args": "arguments passed to vLLM, e.g. [\"--max-model-len\", \"8192\", "
                     "\"--gpu-memory-utilization\", \"0.9\"] (--host, --port and --model are the runtime's)",
        "startup_timeout": "longest a generation may take from launch to ready (/health and a real completion)",
        "drain_timeout": "how long in-flight requests may finish before a generation is stopped",
        "stop_timeout": "after SIGTERM, how long vLLM may take to exit before SIGKILL",
        "memory_release_timeout": "how long to wait for a stopped generation's GPU memory to be freed",
        "queue_size": "requests the proxy holds while no generation serves; more get 503",
        "queue_max_wait": "longest a held request waits for a generation, then 503 (longer than a cold start)",
        "migration_limit": "times a request may move to another generation when its backend dies (sent again, or its stream continued)",
        "retry_after": "seconds sent in Retry-After with a 503",
        "unready_lead": "readiness (/vllm-guard/ready) turns 503 this long before a cold or gated recycle stops "
                        "the serving generation, so a load balancer moves traffic first; 0: at the gap",
        "admin_group": "group of the admin socket (the watchdog and operators in it may send commands)",
        "admin_mode": "mode of the admin socket (octal; owner rw, nothing for others)",
        "max_failures": "unplanned failures within failure_window after which the runtime exits 3 "
                        "(systemd's restart and start limit take over)",
        "failure_window": "window for max_failures",
        "backoff_initial": "wait before restarting after the first failure; doubles with each failure in a row",
        "backoff_max": "longest wait between restarts",
        "request_timeout": "longest a proxied request may run",
        "access_log": "one `request` log line per proxied request (id, generation, status, TTFT)",
        "metrics_addr": "address of the runtime's Prometheus metrics (requests, queue, recycles, failures)",
        "metrics_port": "port of the runtime's Prometheus metrics; 0: none",
        "max_body_mb": "a request body larger than this is refused (413) before it is read",
        "body_buffer_mb": "request bodies held in memory at once, all requests together (503 beyond)",
        "header_timeout": "a new connection must send its request headers within this time",
        "idle_timeout": "a kept-alive connection idle (or a body that stalls) this long is closed",
        "max_connections": "client connections at once; 0: derived from the open-file limit",
        "max_n": "n (and best_of) of one request at most this (400 beyond); also vLLM's own cap "
                 "(VLLM_MAX_N_SEQUENCES in every generation)",
        "max_tokens": "tokens one sequence may generate, given as max_tokens or by vLLM's default (the rest "
                      "of the context), at most this (400 beyond); 0: off (vLLM refuses more than the context)",
        "max_request_tokens": "sequences x max_tokens of one request (the context when max_tokens is not "
                              "set) at most this (400 beyond); at least the context (--max-model-len); 0: off",
        "max_client_requests": "requests one client (one of vLLM's API keys, else its address) may have in progress, "
                               "queued included (429 with Retry-After beyond); 0: off",
        "max_client_tokens": "tokens one client's requests in progress may ask for together (429 with "
                             "Retry-After beyond); at least max_request_tokens; 0: off",
        "recycle_strategy": "how a generation is replaced: \"auto\" (overlap when two fit, else gated, "
                            "else cold), \"overlap\", \"gated\" or \"cold\" (docs/RUNTIME.md)",
        "overlap_margin_mb": "headroom (GPU and host RAM) kept beyond a second generation's footprint "
                             "before overlap is chosen",
        "late_gate_margin_mb": "GPU headroom beyond the serving engine's own memory before a gated successor or the "
                               "standby starts whole beside it on the held weights and KV cache (the late gate)",
        "gate_timeout": "a gated next generation must reach its gate (before CUDA) within this time",
        "standby": "auto: keep the next generation parked at its startup gate while RAM allows (a crash restarts "
                   "from the gate, a recycle uses it); off: none",
        "prestage_weights": "on: a generation parked at its gate first reads the model's weights into page-locked "
                            "RAM, so vLLM's start after the gate copies them from there (costs their size in RAM "
                            "per parked generation, and parks it later); off: none",
        "hold_weights": "auto: on where there is a GPU and (1 - --gpu-memory-utilization) x its memory holds the "
                        "weights + 1 GiB (vLLM's start check); on: a holder process per replica keeps the model's weights "
                        "resident and every generation after the first maps them instead of reading the checkpoint "
                        "(a recycle still frees everything else); off: every start reads the checkpoint",
        "hold_kv_cache": "auto: with a holder on a GPU, the KV cache's buffers are held too and shared by the "
                         "generations that never compute at once, so a gated successor or the standby starts whole "
                         "beside the serving generation and parks ready (a gated recycle is then the handshake, "
                         "the API server's start and /health); off: each generation allocates its own after its gate",
        "warm_start": "on: a generation parked at its gate first imports the modules the last one imported after "
                      "its gate (recorded in the state dir), freezes its heap for the garbage collector and does not "
                      "send vLLM's usage report again; off: vLLM's start as it is",
        "start_cpus": "off: every generation may use all CPUs; auto: on a GPU box a generation starting beside a "
                      "serving one runs on the last quarter of them until it takes over; a number: that many",
        "replicas": "vLLM servers behind the one proxy (one per GPU or tensor-parallel group); they recycle "
                    "one at a time",
        "gpus": "GPU indexes or UUIDs, one replica per GPU (or per --tensor-parallel-size GPUs); "
                "empty: every replica gets the runtime's own environment (CPU, or several servers sharing a GPU)",
    },
    "recycle": {
        "max_requests": "recycle a generation after this many requests (probes never count); 0: off",
        "max_requests_jitter": "add a random 0..N to max_requests per generation, so instances do not "
                               "recycle together",
        "max_uptime": "recycle a generation that has served this long, e.g. \"24h\"; 0: off",
        "max_gpu_memory_growth_mb": "recycle when the GPU memory of vLLM's processes (NVML) grew this many "
                                    "MB since warm-up; 0: off",
        "max_host_rss_growth_mb": "recycle when the host RSS of vLLM's processes grew this many MB since "
                                  "warm-up; 0: off",
        "memory_warmup_requests": "requests served before the memory baseline is taken (allocator pools "
                                  "and caches settle first); the report leaves out the same points",
        "memory_interval": "how often vLLM's memory is read",
        "idle_after": "no request for this long counts as idle (for idle_fraction)",
        "idle_fraction": "recycle early while idle once any limit is this far reached (0.8 = 80 %); 0: off",
        "max_requests_overrun": "only for a generation with no memory reading (else memory bounds the wait): while "
                                "its successor starts, it may take this share of its limit more, then drains anyway",
    },
    "probe": {
        "interval": "time between probes of a serving generation",
        "timeout": "a probe slower than this failed",
        "failures": "failed probes in a row, each with no token generated over the window, that make a hang",
        "progress_window": "a failed probe counts only if vLLM's token counters did not move this long",
        "prompt": "the probe's prompt (one token is generated)",
    },
    "watchdog": {
        "interval": "one sampling tick",
        "dry_run": "decide and record, never act",
        "warmup_requests": "requests per process before its memory slope is fitted",
        "drift_min_requests": "requests in the window before a memory slope is judged",
        "drift_min_points": "readings in the window before a memory slope is judged",
        "noise_floor_mb_per_100": "a memory slope counts as a leak only above this many MB per 100 requests",
        "drift_every": "how often the memory slopes are fitted",
        "forecast_horizon": "recycle (preventive) when a leak's forecast runs out of memory within this time",
        "host_budget_mb": "host memory the service may use, for the forecast; 0: the host's available memory",
        "gpu_budget_mb": "GPU memory the service may use, for the forecast; 0: the GPU's free memory",
        "thermal_window": "window over which throttling is judged",
        "thermal_share": "share of the window throttled (heat or a hardware signal) that triggers a "
                         "preventive recycle",
        "thermal_margin_c": "degrees below the GPU's slowdown temperature that count as too hot",
        "clock_drop_pct": "SM clock this far below its maximum while busy is a sign of throttling",
        "probe_interval": "time between the watchdog's own probes",
        "probe_timeout": "a watchdog probe slower than this failed",
        "hang_failures": "timed-out probes in a row, each with no engine progress over the window, that make "
                         "a replica hung (restart)",
        "progress_window": "a timed-out watchdog probe counts only if vLLM's token counters did not move this long",
        "cooldown": "least time between two actions of the same kind for the same cause",
        "max_actions": "actions within action_window after which the watchdog stops acting and alerts",
        "action_window": "window for max_actions",
        "alert_command": "shell command run on every alert (incident JSON on stdin); empty: none",
        "alert_webhook": "URL that receives every alert as a JSON POST; empty: none",
        "nvml_timeout": "longest one NVML call may take (a GPU off the bus must not stall the loop)",
        "nvml_trace": "replay this NVML trace (JSONL) instead of the live GPUs (tests)",
        "kernel": "kernel messages (Xid, OOM): auto, kmsg, journal, off, or a file to replay",
        "cgroup_root": "where the cgroup file system is mounted",
        "service_cgroup": "the runtime's cgroup, for its OOM-kill counter; empty: found from its pid",
        "metrics_timeout": "longest a scrape of vLLM's /metrics may take",
        "prometheus_addr": "address of the watchdog's Prometheus exporter",
        "prometheus_port": "port of the Prometheus exporter; 0: no exporter",
        "sample_every": "ledger resolution of the newest hour of samples",
        "gpu_profile": "GPU profile to use instead of the one picked from the GPU's name "
                       "(rtx4090, a100, h100, h200)",
    },
    "soak": {
        "url": "server to soak; unset: the guard of the state dir",
        "scenario": "S1 512/256 tokens at concurrency 1, S2 8192/1024/4, S3 65536/512/1, S4 2048/512/32, "
                    "or custom",
        "duration": "run time; no request is sent after it",
        "rate": "open loop: mean requests per second; unset: a closed loop at concurrency",
        "burstiness": "open loop: gamma shape of the gaps between arrivals; 1 = Poisson",
        "concurrency": "closed loop: requests in flight; open loop: a cap on them",
        "db": "ledger file to write; unset: the state dir's",
        "seed": "seed of the schedule and the prompts",
        "mode": "steady or burst (the same mean rate packed into on-windows)",
        "timeout": "per-request timeout",
        "prompt_tokens": "prompt length in tokens (custom scenario)",
        "output_tokens": "output length in tokens (custom scenario)",
        "model": "model name to request; unset: the server's first",
        "state_dir": "the guard whose memory readings are sampled; unset: [server] state_dir",
        "sample_interval": "how often the guard's status is read",
    },
    "inject": {
        "host_leak_mb_per_request": "leak this much host memory per request in EngineCore",
        "device_leak_mb_per_request": "leak this much GPU memory per request",
        "block_leak_every": "lose one KV block reference every N requests",
        "gpu_memory_budget_gib": "emulate a GPU of this size (reserve the rest)",
        "hang_after_requests": "hang the engine after N requests",
        "crash_after_requests": "crash the engine after N requests",
        "pretend_amx": "vLLM believes the CPU has AMX tiles (on a CPU without them its AMX attention dies of SIGILL; needs avx512_bf16)",
    },
    "patches": {
        "enabled": "false: load no fix at all",
        "disable": "fixes to leave out (`vllm-guard patches list` shows them all), e.g. attn-isa, idle-release",
        "idle_release_after": "idle time after which memory is released once (gc, malloc_trim, CUDA cache)",
        "malloc_trim": "return freed host memory to the system when idle",
        "expandable_segments": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation)",
        "malloc_arena_max": "MALLOC_ARENA_MAX for vLLM's processes; 0: glibc's default",
        "audit_reclaim": "free KV blocks held by no live request (false: only count them)",
        "pace_beside": "seconds an engine starting beside a serving generation leaves the GPU to it per second of "
                       "its own profile run and warm-up (0: off)",
    },
    "ledger": {
        "request_retention": "how long the runtime keeps one row per request (timings, outcome, tokens); "
                             "0: none (the per-minute histograms stay)",
    },
    "install": {
        "user": "system user of the runtime; its group owns the admin socket and the ledger",
        "watchdog_user": "system user of the watchdog (a member of the runtime's group)",
        "memory_high": "host memory above which the service is throttled (MemoryHigh=)",
        "memory_max": "host memory at which the kernel OOM-kills inside the service (MemoryMax=)",
        "watchdog_sec": "systemd kills a runtime that has not pinged for this long (WatchdogSec=)",
        "restart_sec": "wait before systemd restarts a failed runtime (RestartSec=)",
        "start_limit_interval": "window of the start limit (StartLimitIntervalSec=)",
        "start_limit_burst": "starts within the window after which systemd gives up (StartLimitBurst=)",
        "timeout_start": "longest before the runtime's first word to systemd (it extends this while loading)",
        "revive_every": "how often vllm-guard-revive.timer retries a unit that hit its start limit",
        "env": "extra environment for the runtime, e.g. { VLLM_API_KEY = \"...\" }",
    },
}

# Shown (commented) for keys whose default is "unset"
EXAMPLES: dict[tuple[str, str], Any] = {
    ("soak", "url"): "http://127.0.0.1:8000", ("soak", "scenario"): "S1", ("soak", "duration"): 86400.0,
    ("soak", "rate"): 2.0, ("soak", "burstiness"): 1.0, ("soak", "concurrency"): 4,
    ("soak", "db"): "/var/lib/vllm-guard/ledger.sqlite", ("soak", "seed"): 0, ("soak", "mode"): "steady",
    ("soak", "timeout"): 600.0, ("soak", "prompt_tokens"): 512, ("soak", "output_tokens"): 256,
    ("soak", "model"): "", ("soak", "state_dir"): "/var/lib/vllm-guard", ("soak", "sample_interval"): 2.0,
}


def duration_text(seconds: float) -> str:
    """`10m`, `24h`, `14d`, `90s`, `0.25s`: the largest whole unit (what people write)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and float(seconds) % size == 0:
            return f"{int(seconds // size)}{unit}"
    return C.format_duration(seconds)


def value_text(section: str, key: str, value: Any, duration: bool) -> str:
    """A TOML literal that `core.config` reads back to `value` (`duration`: a `Duration` key)."""
    if value is None:
        return "\"\""
    if duration:
        return json.dumps(duration_text(float(value)))
    if isinstance(value, bool):
        return "true" if value else "false"
    if key == "admin_mode":
        return f"0o{value:o}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"cannot write [{section}] {key} = {value!r} to TOML")


def _comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent + "# ", subsequent_indent=indent + "# ")


def section_lines(cfg: GuardConfig, name: str) -> list[str]:
    cls = C.SECTIONS[name]
    obj = getattr(cfg, name)
    durations = C.duration_keys(cls)
    explicit = cfg.explicit.get(name, frozenset())
    lines = [*_comment(SECTION_HELP.get(name, "")), f"[{name}]"]
    for key in cls.__struct_fields__:
        value, duration = getattr(obj, key), key in durations
        lines += _comment(HELP.get(name, {}).get(key, "see the documentation"))
        if key in explicit and value is not None:
            lines.append(f"{key} = {value_text(name, key, value, duration)}")
        else:
            shown = EXAMPLES.get((name, key), value) if value is None else value
            lines.append(f"# {key} = {value_text(name, key, shown, duration)}")
    return lines


def render(cfg: GuardConfig, header: str) -> str:
    """The whole file: a header, then every section with every key."""
    parts = [header.rstrip(), "# A commented key shows its default; remove the `# ` to set it.", ""]
    for name in C.SECTIONS:
        parts += [*section_lines(cfg, name), ""]
    return "\n".join(parts)
