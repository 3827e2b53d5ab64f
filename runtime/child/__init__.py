"""The vLLM child: one generation's process group, its processes, the keeper that outlives the runtime."""
