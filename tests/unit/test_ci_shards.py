"""CI's split of the tests over its torch legs (tests/ci_shards.py): each test on exactly one
leg, the reference leg's and the interpreter leg's tests where they belong, a module's other
tests together (with its extended ones), and the default suite's time spread evenly."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests import ci_shards


@dataclass
class Collected:
    """What the plan reads of a collected pytest item: its node id and its markers."""
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_each_test_runs_once_forced_ones_where_they_belong_and_a_module_stays_together():
    items = [Collected("tests/unit/test_a.py::test_one"),
             Collected("tests/unit/test_a.py::test_kernel", {"triton_interpreter"}),
             Collected("tests/unit/test_a.py::test_two"),
             Collected("tests/unit/test_b.py::test_readme", {"once_per_ci"}),
             Collected("tests/unit/test_b.py::test_long", {"extended"}),
             Collected("tests/unit/test_b.py::test_three"),
             Collected("tests/unit/test_c.py::test_four"),
             Collected("tests/unit/test_d.py::test_five")]
    shards = ci_shards.plan(items, 4, {})
    assert len(shards) == len(items) and all(0 <= shard < 4 for shard in shards)
    assert shards[1] == ci_shards.INTERPRETER_SHARD
    assert shards[3] == shards[4] == ci_shards.REFERENCE_SHARD
    assert shards[0] == shards[2]  # test_a's free tests share a leg (its module fixtures)
    # test_b's free test goes with its extended one (their module fixtures), and the three
    # free modules of equal (unknown) time to the other legs
    assert shards[5] == ci_shards.REFERENCE_SHARD
    assert sorted({shards[0], shards[6], shards[7]}) == [1, 2, 3]
    assert ci_shards.plan(list(reversed(items)), 4, {}) == list(reversed(shards))


def test_the_longest_modules_go_first_to_the_least_loaded_leg():
    seconds = {"m10": 10.0, "m8": 8.0, "m6": 6.0, "m4": 4.0, "m2a": 2.0, "m2b": 2.0}
    items = [Collected(f"tests/{name}.py::test_x") for name in seconds]
    durations = {f"tests/{name}.py::test_x": value for name, value in seconds.items()}
    shards = ci_shards.plan(items, 2, durations)
    loads = [sum(value for value, shard in zip(seconds.values(), shards) if shard == index)
             for index in range(2)]
    assert loads == [16.0, 16.0]
    # a test not in the durations counts SHORT_TEST_SECONDS: one more module goes to leg 0
    extra = ci_shards.plan([*items, Collected("tests/new.py::test_y")], 2, durations)
    assert extra[:-1] == shards and extra[-1] == 0


def test_the_recorded_durations_name_collected_tests():
    """.ci/durations.json names tests by node id (`python3 .ci/durations.py` rewrites it):
    most of its entries still exist, so the split is the measured one."""
    durations = ci_shards.read_durations()
    assert len(durations) > 100 and all(value >= 1.0 for value in durations.values())
    modules = {nodeid.split("::")[0] for nodeid in durations}
    root = ci_shards.DURATIONS.parents[1]
    existing = [module for module in modules if (root / module).exists()]
    assert len(existing) >= 0.9 * len(modules)


def test_the_workers_get_the_longest_modules_first_each_module_together():
    items = [Collected("tests/a.py::test_1"), Collected("tests/b.py::test_1"),
             Collected("tests/a.py::test_2"), Collected("tests/c.py::test_1"),
             Collected("tests/b.py::test_2"), Collected("tests/d.py::test_1")]
    durations = {"tests/a.py::test_1": 3.0, "tests/a.py::test_2": 3.0,  # a: 6 s
                 "tests/b.py::test_2": 9.0,  # b: 9.2 s (test_1 unknown: SHORT_TEST_SECONDS)
                 "tests/d.py::test_1": 6.0}  # d: 6 s, after a by name
    ordered = ci_shards.longest_modules_first(items, durations)
    assert [item.nodeid for item in ordered] == [
        "tests/b.py::test_1", "tests/b.py::test_2", "tests/a.py::test_1", "tests/a.py::test_2",
        "tests/d.py::test_1", "tests/c.py::test_1"]
