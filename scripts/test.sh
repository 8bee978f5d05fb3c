#!/usr/bin/env bash
# Runs the whole test suite (lint, unit, FUSE + SeaweedFS integration) on a fresh machine:
# installs what is missing first. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/pytest -q "$@"
