#!/usr/bin/env bash
# Run the test suite: ./run_tests.sh [pytest args]   (add "-m slow" for the 4-process cases)
set -euo pipefail
cd "$(dirname "$0")"
# Bytecode is written (to __pycache__, git-ignored) even where the environment says not to:
# with PYTHONDONTWRITEBYTECODE=1 (set on the machines this runs on) every test process, and
# every interpreter a test starts, compiled the sources of torchtitan, transformers, datasets
# and titan_hybrid again (uv installs wheels without their .pyc), and pytest rewrote every test
# module again: collecting the tests took 40 s instead of 27 s.
unset PYTHONDONTWRITEBYTECODE
source scripts/bootstrap.sh
ruff check --quiet .  # pyflakes + import order on the whole tree (pyproject.toml [tool.ruff])
# The tests run in parallel worker processes (pytest-xdist), one per core up to 4: a single
# process leaves much of a 2-core machine's second core idle (process starts, gloo waits); two
# workers run the default suite in ~380 s instead of ~570 s (a fresh clone, issue 45). Each
# test is still the same real run.
# A worker takes whole modules (loadfile), so a module's shared runs are made once, in the
# order tests/conftest.py puts them: the longest modules first (tests/ci_shards.py).
# TITAN_HYBRID_TEST_WORKERS=1 (or -n 0) runs them in this process, in that order.
workers="${TITAN_HYBRID_TEST_WORKERS:-$(nproc)}"
if [ "$workers" -gt 4 ]; then workers=4; fi
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
exec python -m pytest -q "${parallel[@]}" "$@"
