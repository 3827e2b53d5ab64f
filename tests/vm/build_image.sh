#!/bin/bash
# Build a small Debian bookworm root tree for the real-systemd test (booted with systemd-nspawn).
# Usage: tests/vm/build_image.sh OUTDIR   (needs: mmdebstrap; run as root). Idempotent: an
# existing tree with a completion marker is reused.
# Python and the project are NOT in the image: the test binds the project, its venv and the venv's
# base interpreter read-only at the same paths, so only their shared libraries are installed here.
set -euo pipefail
out=${1:?usage: build_image.sh OUTDIR}
tree="$out/tree"
[ -f "$out/built" ] && { echo "tree exists in $tree"; exit 0; }
rm -rf "$tree"
mkdir -p "$out"
pkgs=systemd,systemd-sysv,dbus,procps,iproute2,curl,ca-certificates
pkgs+=,libssl3,libsqlite3-0,libffi8,libgdbm6,libuuid1,libstdc++6,libgomp1,libnuma1,libbz2-1.0,liblzma5,libreadline8,zlib1g
mmdebstrap --variant=minbase --include="$pkgs" \
  --customize-hook='echo vmtest > "$1/etc/hostname"' \
  --customize-hook='chmod 755 "$1/root"' \
  --customize-hook='mkdir -p "$1/srv/share"' \
  bookworm "$tree"
# The guest runs guest.sh from the shared run dir once, then powers off (the container exits).
cat > "$tree/etc/systemd/system/vm-test.service" <<'UNIT'
[Unit]
Description=vllm-guard real-systemd test driver
After=multi-user.target
[Service]
Type=oneshot
StandardOutput=journal+console
StandardError=journal+console
ExecStart=/bin/bash /srv/share/guest.sh
ExecStopPost=/bin/systemctl --no-block poweroff
UNIT
ln -sf /etc/systemd/system/vm-test.service "$tree/etc/systemd/system/multi-user.target.wants/vm-test.service"
touch "$out/built"
echo "built $tree"
