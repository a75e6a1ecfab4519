#!/usr/bin/env bash
# Create .venv (if needed) and install sagenb with its test and docs tools; a no-op when nothing changed.
# torch is pinned through scripts/constraints.txt: an unpinned torch would pull a multi-GB CUDA
# build on machines where the CPU wheel is what we want.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.sagenb-installed
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c 'import sagenb' 2>/dev/null; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
log=$(mktemp)
echo "installing sagenb and its dependencies into .venv (about a minute the first time)"
if ! { .venv/bin/python -m pip install --upgrade pip &&
       .venv/bin/python -m pip install -c scripts/constraints.txt -e '.[test,docs,tensorboard]' &&
       # rfc3987-syntax (pulled in by jupyterlab through jupyter-events) compiles its grammars
       # whenever jsonschema is imported: 0.7 s idle, 2-3 s on a busy 2-core machine, paid by
       # every kernel's first dashboard, the JupyterLab server and nbformat. jsonschema guards
       # that import; only its "iri" format checks go.
       .venv/bin/python -m pip uninstall -y rfc3987-syntax; } >"$log" 2>&1; then
  cat "$log"; exit 1
fi
echo "$want" > "$stamp"
