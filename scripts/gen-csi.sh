#!/usr/bin/env bash
# Regenerate objcache/csi/csi_pb2*.py from objcache/csi/csi.proto with grpcio-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I objcache/csi --python_out=objcache/csi \
    --grpc_python_out=objcache/csi objcache/csi/csi.proto
# The generated service module imports its messages as a top-level module: make it relative.
sed -i 's/^import csi_pb2 as csi__pb2$/from objcache.csi import csi_pb2 as csi__pb2/' \
    objcache/csi/csi_pb2_grpc.py
