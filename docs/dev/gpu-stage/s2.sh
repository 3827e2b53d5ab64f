#!/bin/bash
# staging call 2: join vllm_C, unpack it and _moe_C into /tmp/site
set -u
mkdir -p /tmp/parts/c && cat /tmp/parts/vllm_C.a .gpu/q2/vllm_C.b > /tmp/parts/c/vllm_C.tar.xz || exit 2
python3 .gpu/stage/unpack.py /tmp/parts/c /tmp/site || exit 3
python3 .gpu/stage/unpack.py .gpu/q2 /tmp/site || exit 4
rm -rf /tmp/parts
echo "s2 done"
