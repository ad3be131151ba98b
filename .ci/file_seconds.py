"""Print tests/conftest.py's FILE_SECONDS table from a pytest junit report.

    python -m pytest --junitxml=/tmp/junit.xml    # the whole suite, as CI runs it
    python .ci/file_seconds.py /tmp/junit.xml     # paste the lines into FILE_SECONDS

Each test file's test durations are summed (setup and teardown included: module fixtures are
counted in the file that uses them), heaviest first, rounded to seconds.
"""

from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def file_seconds(junit_path: str) -> dict[str, float]:
    totals: collections.Counter[str] = collections.Counter()
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((f"{m}.py" for m in module if m.startswith("test_")), None)
        if name is not None:
            totals[name] += float(case.get("time", 0.0))
    return dict(totals.most_common())


if __name__ == "__main__":
    for name, seconds in file_seconds(sys.argv[1]).items():
        print(f'    "{name}": {seconds:.0f},')
