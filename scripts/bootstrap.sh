#!/usr/bin/env bash
# Create or reuse .venv at the repository root with titan_hybrid installed (editable).
# On machines without CUDA, torch's CPU build is installed first so that nothing pulls a
# multi-GB CUDA build. Sourced by run_train.sh and run_tests.sh.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PY="$VENV/bin/python"
STAMP="$VENV/.titan_hybrid_installed"

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
# This machine's pip configuration may name local package folders that do not exist; pip warns
# about each one. Keep the rest of pip's output.
quiet_pip() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

if [ ! -f "$STAMP" ] || [ "$REPO_ROOT/pyproject.toml" -nt "$STAMP" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        quiet_pip install --quiet "torch==2.13.*" "triton==3.7.1"
    else
        quiet_pip install --quiet "torch==2.13.0" "triton==3.7.1"
    fi
    quiet_pip install --quiet -e "$REPO_ROOT[test]"
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
