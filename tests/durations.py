"""Merge the per-process duration records of test runs (``MOE_EP_DURATIONS_OUT=<dir>``) into tests/durations.json,
which ``tests/conftest.py`` reads to balance the parallel test processes of scripts/test.sh.

    MOE_EP_DURATIONS_OUT=/tmp/d bash scripts/test.sh; MOE_EP_DURATIONS_OUT=/tmp/d bash scripts/test.sh -m slow
    python tests/durations.py /tmp/d
"""

from __future__ import annotations

import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python tests/durations.py <directory of MOE_EP_DURATIONS_OUT records>", file=sys.stderr)
        return 2
    path = os.path.join(HERE, "durations.json")
    try:
        with open(path) as f:
            merged = json.load(f)
    except (OSError, ValueError):
        merged = {}
    files = sorted(glob.glob(os.path.join(argv[0], "*.json")))
    for name in files:
        with open(name) as f:
            merged.update(json.load(f))
    with open(path, "w") as f:
        json.dump(dict(sorted(merged.items())), f, indent=0)
        f.write("\n")
    print(f"tests/durations.json: {len(merged)} tests from {len(files)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
