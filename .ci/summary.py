"""The end of a CI run (.ci/run): each leg's 10 slowest tests, then one table of the legs
(set-up time, test time, counts) and the whole run's time. The table comes last: a CI report
that keeps only the head and the tail of a long output (a failure's log fills the middle) still
shows it.

    python3 .ci/summary.py REPORTS_DIR TOTAL_SECONDS

REPORTS_DIR holds, per leg, `LEG.setup_s` (the bootstrap's seconds) and one pytest JUnit XML
per test command of the leg (`LEG.PART.xml`). Standard library only: it runs outside the venvs.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path


def read_leg(reports: Path, leg: str) -> dict:
    counts = defaultdict(int)
    test_s, cases = 0.0, []
    for xml in sorted(reports.glob(f"{leg}.*.xml")):
        for suite in ElementTree.parse(xml).getroot().iter("testsuite"):
            test_s += float(suite.get("time", 0))
            for key in ("tests", "failures", "errors", "skipped"):
                counts[key] += int(suite.get(key, 0))
            for case in suite.iter("testcase"):
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                cases.append((float(case.get("time", 0)), name))
    setup_file = reports / f"{leg}.setup_s"
    setup_s = float(setup_file.read_text()) if setup_file.exists() else 0.0
    return {"setup_s": setup_s, "test_s": test_s, "counts": counts,
            "slowest": sorted(cases, reverse=True)[:10]}


def main(reports: Path, total_s: float) -> None:
    legs = sorted({path.name[:-len(".setup_s")] for path in reports.glob("*.setup_s")},
                  key=lambda leg: min(p.stat().st_mtime for p in reports.glob(f"{leg}.*")))
    rows = {leg: read_leg(reports, leg) for leg in legs}
    for leg, row in rows.items():
        print(f"\n== {leg}: the 10 slowest tests")
        for seconds, name in row["slowest"]:
            print(f"{seconds:8.1f} s  {name}")
    print("\n== CI summary")
    print(f"{'leg':<22} {'set-up s':>9} {'tests s':>8} {'tests':>6} {'passed':>7} "
          f"{'failed':>7} {'skipped':>8}")
    for leg, row in rows.items():
        c = row["counts"]
        failed = c["failures"] + c["errors"]
        passed = c["tests"] - failed - c["skipped"]
        print(f"{leg:<22} {row['setup_s']:>9.0f} {row['test_s']:>8.0f} {c['tests']:>6} "
              f"{passed:>7} {failed:>7} {c['skipped']:>8}")
    print(f"{'whole run':<22} {total_s:>18.0f} s (CI's limit: 5400 s; the budget: 3600 s)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
