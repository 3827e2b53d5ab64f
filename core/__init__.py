"""The core every vllm-guard package imports, and that imports none of them.

What lives here is what more than one process or package must agree on: the typed config,
the ledger schema and its classes, the one MTBF rule, the admin protocol, the vLLM client
rules (probe, progress), NVML and host readers, the GPU index and throttle rules, time
formatting, errors, logging and sd_notify. Nothing here imports vLLM or torch.
"""

__version__ = "0.2.0"
