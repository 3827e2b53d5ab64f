#!/bin/bash
# put a committed tree (git archive, .tgz) at /tmp/src and install it offline into /tmp/site
set -u
rm -rf /tmp/src && mkdir -p /tmp/src && tar -xzf "$1" -C /tmp/src || exit 1
cd /tmp/src && python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . \
  && echo "project installed into /tmp/site (commit $(cat "${1%.tgz}.commit" 2>/dev/null))" || exit 2
