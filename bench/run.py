"""`make bench`: run every bench/bench_*.py in its own process and print their reports.

Each benchmark measures inferd against a baseline in the same run and prints ratios;
none fails on a timing. Run one alone with `.venv/bin/python bench/bench_NAME.py`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    only = set(sys.argv[1:])
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        if only and script.stem.removeprefix("bench_") not in only:
            continue
        print(f"\n=== {script.stem} ===", flush=True)
        if subprocess.run([sys.executable, str(script)], cwd=HERE.parent).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"\nbenchmarks that crashed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
