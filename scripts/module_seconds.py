"""Write ``tests/module_seconds.json``: each test module's seconds in a full run, from that run's log.

The suite runs its modules on 2 pytest-xdist workers, a module always in one (``--dist loadfile``).
xdist hands out modules in the order it is given them; ``tests/conftest.py`` orders them by these
seconds, longest first (LPT, longest processing time first: the run's end waits for no long module
started late). Regenerate after a change of the suite's costs:

    scripts/test.sh --durations=0 > /tmp/suite.log; .venv/bin/python scripts/module_seconds.py /tmp/suite.log

The log's ``--durations`` lines (``12.34s call     tests/test_x.py::test_y``, setup and teardown
included) are summed per module; modules absent from the log keep their old figure.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "module_seconds.json")
LINE = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(tests/[^:\s]+\.py)::")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: module_seconds.py LOG (a pytest log with --durations=0)", file=sys.stderr)
        return 2
    seconds: Counter = Counter()
    with open(argv[0], encoding="utf-8", errors="replace") as fh:
        for line in fh:
            m = LINE.match(line)
            if m:
                seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        print(f"{argv[0]}: no --durations lines (run pytest with --durations=0)", file=sys.stderr)
        return 2
    old = json.load(open(OUT)) if os.path.exists(OUT) else {}
    old.update({k: round(v, 1) for k, v in seconds.items()})
    with open(OUT, "w") as fh:
        json.dump(dict(sorted(old.items(), key=lambda kv: -kv[1])), fh, indent=0)
        fh.write("\n")
    print(f"{OUT}: {len(old)} modules, {sum(old.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
