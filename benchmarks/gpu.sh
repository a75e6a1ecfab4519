#!/usr/bin/env bash
# Every benchmark on a one-GPU machine, in one command from the repository root:
#
#     bash benchmarks/gpu.sh            # results in benchmarks/results (and $OUT when set)
#
# Uses the machine's own python3 and torch (any torch >= 2.6 with CUDA). What else the project
# needs comes from PyPI, or, on a machine without network, from the wheels in .whl/ that
# `bash benchmarks/fetch_wheels.sh` downloads beforehand on a machine with network. Then
# run_all.py --quick: the GPU comparison (one_gpu.py) and the whole CPU set, in under 10 minutes
# on 16 cores and one GPU (budget; first to be measured by the session that gets such a machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    site=/tmp/sagenb-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    "$PY" -m pip install -q -e .   # the installed torch satisfies torch>=2.6: none is pulled
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, sagenb; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
"$PY" benchmarks/run_all.py --quick
if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/summary.md benchmarks/results/summary.json benchmarks/results/one_gpu.* "$OUT"/ || true
fi
