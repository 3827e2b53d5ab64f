#!/bin/bash
# staging call 1: keep vllm_C's first half on the machine
set -u
mkdir -p /tmp/parts && cp .gpu/q1/vllm_C.a /tmp/parts/ && ls -la /tmp/parts
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
echo "s1 done"
