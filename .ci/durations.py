"""Write .ci/durations.json, the seconds each test of a second or more takes, from pytest JUnit
reports: CI's split of the tests over its legs reads it (tests/ci_shards.py).

    python3 .ci/durations.py REPORT.xml [REPORT.xml ...]

Take the reports of one unsharded run of what CI runs (`./run_tests.sh -m "not slow"
--junitxml=...`; CI's own reports, .ci-reports/*.xml, serve too). Only the proportions matter:
the figures of a slow machine balance the legs as well as a fast one's. Standard library only.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

LONG_TEST_SECONDS = 1.0  # shorter tests count tests/ci_shards.py's SHORT_TEST_SECONDS
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def test_seconds(reports: list[Path]) -> dict[str, float]:
    seconds = {}
    for report in reports:
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            if float(case.get("time", 0)) >= LONG_TEST_SECONDS:
                module = case.get("classname", "").replace(".", "/") + ".py"
                seconds[f"{module}::{case.get('name')}"] = round(float(case.get("time")), 1)
    return dict(sorted(seconds.items()))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    durations = test_seconds([Path(arg) for arg in sys.argv[1:]])
    DURATIONS.write_text(json.dumps(durations, indent=0) + "\n")
    print(f"{DURATIONS}: {len(durations)} tests, {sum(durations.values()):.0f} s")
