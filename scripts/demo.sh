#!/usr/bin/env bash
# Quick start, command 1: set up, then train data-parallel on a local pool of 2 engines and
# write the dashboard to artifacts/dashboard.html.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sagenb.notebook.demo "$@"
