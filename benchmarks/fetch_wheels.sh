#!/usr/bin/env bash
# Download, into .whl/ (ignored by git), the wheels benchmarks/gpu.sh installs on a GPU machine
# that has python3 3.12 and torch but no network: sagenb's dependencies beyond those, at the
# versions CI measures (scripts/constraints.txt and their own dependencies as CI resolved them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl \
    ipyparallel==9.2.0 ipykernel==7.4.0 ipywidgets==8.1.9 plotly==7.1.0 anywidget==0.11.0 \
    ipython==9.18.1 ipython_pygments_lexers==1.1.1 jupyter_client==8.10.0 jupyter_core==5.9.1 \
    pyzmq==27.3.0 tornado==6.6.1 traitlets==5.16.1 comm==0.2.3 debugpy==1.8.22 \
    decorator==5.3.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 nest-asyncio2==1.7.4 \
    pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 \
    executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 platformdirs==4.14.8 \
    jupyterlab_widgets==3.0.17 widgetsnbextension==4.0.16 psygnal==0.16.1 narwhals==2.29.0
du -sh .whl
