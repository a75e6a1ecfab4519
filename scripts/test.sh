#!/usr/bin/env bash
# Quick start, command 2: set up, lint, then run the whole test suite on real engine pools.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check sagenb tests
exec .venv/bin/python -m pytest "$@"
