#!/usr/bin/env bash
# Quick start, command 2: set up, lint, then run the whole test suite on real engine pools.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The browser tests use Debian's Chromium (no browser download): one renders the saved
# dashboard, one drives notebook 1 in JupyterLab through Playwright. Without it they skip.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing Debian's chromium for the browser tests (about a minute)"
  { apt-get update -qq >/dev/null && apt-get install -y -qq chromium >/dev/null; } ||
    echo "could not install chromium: the browser tests will be skipped"
fi
.venv/bin/python -m ruff check sagenb tests
exec .venv/bin/python -m pytest "$@"
