"""`make bench`: run every bench/<name>_vs_<peer>.py comparison (dpo_vs_trl.py, kto_vs_trl.py, ray_vs_local.py, ...),
one after the other, and print their summary lines together at the end.

    python bench/run.py                 # all comparisons
    python bench/run.py dpo kto         # only bench/dpo_vs_trl.py and bench/kto_vs_trl.py

Each script is a subprocess (cwd: the repository root; bench/ and the root on PYTHONPATH, so the scripts and the
workers they launch import `harness`) whose output streams through; a script reports each comparison as one line
`<name> ratio=<x> ...` (the rollout bench adds `weight_sync_s=...` and `ppo_generation_share ...`). Those lines are
collected and printed again at the end. Exits non-zero if any script failed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SUMMARY = re.compile(r"^(\S+ ratio=|weight_sync_s=|ppo_generation_share )")  # the lines each script ends with


def main(argv: list[str]) -> int:
    scripts = sorted(BENCH.glob("*_vs_*.py"))
    if argv:
        scripts = [s for s in scripts if s.name.split("_vs_")[0] in argv]
        if not scripts:
            print(f"no bench/<name>_vs_<peer>.py for {argv}", file=sys.stderr)
            return 2
    summaries, failed, t0 = [], [], time.time()
    path = os.pathsep.join(p for p in (str(BENCH), str(BENCH.parent), os.environ.get("PYTHONPATH")) if p)
    for script in scripts:
        print(f"==== {script.name} ====", flush=True)
        start = time.time()
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=BENCH.parent, env={**os.environ, "PYTHONPATH": path})
        for line in proc.stdout:
            print(line, end="", flush=True)
            if SUMMARY.match(line):
                summaries.append(line.rstrip())
        if proc.wait() != 0:
            failed.append(f"{script.name} (exit {proc.returncode})")
        print(f"==== {script.name}: {time.time() - start:.0f}s ====", flush=True)
    print(f"\n==== summary ({len(scripts)} scripts, {time.time() - t0:.0f}s) ====")
    for line in summaries:
        print(line)
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
