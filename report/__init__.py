"""`vllm-guard report`: MTBF, leaks, thermals, latency and errors from a ledger (read-only).

Reads every writer's tables through the core's typed rows and records; imports only
`vllm_guard.core`.
"""
