"""vllm_guard.runtime: `vllm-guard serve`, the supervised vLLM behind a streaming proxy."""
