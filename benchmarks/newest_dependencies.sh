#!/usr/bin/env bash
# The newest releases that pyproject.toml admits, tested: run once a turn, before widening a
# range there, and whenever a dependency publishes a release.
#
#     bash benchmarks/newest_dependencies.sh     # about 5 minutes; writes results/newest_dependencies.md
#
# CI pins what it installs (scripts/constraints.txt); a user's `pip install sagenb` takes the
# newest release each range admits, which nobody had run: transformers 5.25 broke --delay-init
# with from_pretrained while CI passed on 5.24. This installs sagenb with its extras into a
# fresh venv with only torch pinned (never an unpinned torch: that downloads a CUDA build),
# prints what differs from the constraints file, and runs the fast lane and the pretrained
# tests there. pyproject.toml's ranges admit only what this run or CI has passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PY" -m venv "$venv"
pins=$(mktemp)
grep -E '^torch==' scripts/constraints.txt > "$pins"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c "$pins" -e '.[test,docs,tensorboard]'
report=benchmarks/results/newest_dependencies.md
{
    echo "# The newest releases pyproject.toml admits ($(date -u +%Y-%m-%d))"
    echo
    echo "From \`bash benchmarks/newest_dependencies.sh\`: a fresh venv, only torch pinned."
    echo "Releases that differ from scripts/constraints.txt (the CI's), as installed:"
    echo
    echo '```'
    "$venv/bin/python" -m pip list --format=freeze | while IFS='==' read -r name _ version; do
        pinned=$(grep -iE "^${name}==" scripts/constraints.txt | cut -d= -f3 || true)
        if [ -n "$pinned" ] && [ "$pinned" != "${version%%+*}" ]; then  # torch's +cpu
            echo "$name $version (CI: $pinned)"
        fi
    done
    echo '```'
    echo
    echo "Tests in that venv:"
    echo
    echo '```'
} > "$report"
status=0
lane() {  # a pytest run in the venv, its closing line into the report
    if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" > "$venv.log" 2>&1; then
        status=1
    fi
    echo "pytest $*: $(grep -E '(passed|failed|error)' "$venv.log" | tail -1)" | tee -a "$report"
    grep -E '^(FAILED|ERROR) ' "$venv.log" | tee -a "$report" || true
}
lane -m "not pool"
lane tests/test_pretrained.py
echo '```' >> "$report"
exit $status
