"""How CI splits the tests over its torch legs (`--ci-shard K/N`, .ci/run): each test runs on
one leg.

- A test marked once_per_ci (the scripts, the README's commands, what is the same under every
  torch) or extended (the long cases kept out of the default suite, checked under the reference
  torch only) runs on shard 0, the reference torch's leg.
- A test marked triton_interpreter runs on shard 1, the leg of the lent GPU machine's torch and
  Triton, whose interpreter is the one that matters.
- Every other test runs where its module goes, so a module's shared runs (its module-scoped
  fixtures) are made once: a module with extended tests goes to shard 0 with them, the others
  longest first, each to the shard whose such tests take the least time so far, so each torch
  runs about a quarter of the default suite. A test's time is read from .ci/durations.json
  (`python3 .ci/durations.py` writes it from JUnit reports: the tests of a second or more); a
  test missing there counts SHORT_TEST_SECONDS.

The legs run one after the other, so the split does not change CI's time: the balance spreads
the default suite over the torches. The plan is a function of the collected tests alone, so
every pytest-xdist worker makes the same one.

The same durations order the modules for the workers (`longest_modules_first`): run_tests.sh
gives each pytest-xdist worker whole modules (`--dist loadfile`), so a module's shared runs
(its module-scoped fixtures) are made once, not once per worker; and the longest modules go
first, so no worker is left running a long module alone at the end.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

REFERENCE_SHARD = 0
INTERPRETER_SHARD = 1
SHORT_TEST_SECONDS = 0.2
DURATIONS = Path(__file__).resolve().parents[1] / ".ci" / "durations.json"


def forced_shard(item) -> int | None:
    if item.get_closest_marker("once_per_ci") or item.get_closest_marker("extended"):
        return REFERENCE_SHARD
    if item.get_closest_marker("triton_interpreter"):
        return INTERPRETER_SHARD
    return None


def plan(items: list, count: int, durations: dict[str, float]) -> list[int]:
    """The shard (0 <= shard < count) of each of `items`, in their order. `durations` maps a
    test's node id to the seconds it took."""
    shards: list[int | None] = [None] * len(items)
    load = [0.0] * count
    free: dict[str, list[int]] = defaultdict(list)
    seconds = [durations.get(item.nodeid, SHORT_TEST_SECONDS) for item in items]
    for position, item in enumerate(items):
        shard = forced_shard(item)
        if shard is None:
            free[item.nodeid.split("::")[0]].append(position)
        else:
            shards[position] = shard % count
    module_seconds = {module: sum(seconds[position] for position in positions)
                      for module, positions in free.items()}
    with_extended = {item.nodeid.split("::")[0] for item in items
                     if item.get_closest_marker("extended")}
    for module in sorted(free, key=lambda name: (name not in with_extended,
                                                 -module_seconds[name], name)):
        shard = (REFERENCE_SHARD if module in with_extended
                 else min(range(count), key=lambda index: (load[index], index)))
        load[shard] += module_seconds[module]
        for position in free[module]:
            shards[position] = shard
    return shards


def longest_modules_first(items: list, durations: dict[str, float]) -> list:
    """`items` with their modules in order of their total seconds, longest first (ties by
    name), each module's tests together in their own order."""
    module_seconds: dict[str, float] = defaultdict(float)
    for item in items:
        module_seconds[item.nodeid.split("::")[0]] += durations.get(item.nodeid,
                                                                   SHORT_TEST_SECONDS)
    return sorted(items, key=lambda item: (-module_seconds[item.nodeid.split("::")[0]],
                                           item.nodeid.split("::")[0]))


def read_durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
