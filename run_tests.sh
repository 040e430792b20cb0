#!/usr/bin/env bash
# Run the test suite: ./run_tests.sh [pytest args]   (add "-m slow" for the 4-process cases)
set -euo pipefail
cd "$(dirname "$0")"
source scripts/bootstrap.sh
ruff check --quiet .  # pyflakes + import order on the whole tree (pyproject.toml [tool.ruff])
exec python -m pytest -q "$@"
