"""The load generator (`vllm-guard soak`): open-loop arrivals, streamed results, resume.

Owns the ledger's `runs`, `requests` and `soak_*` tables; imports only `vllm_guard.core`.
"""
