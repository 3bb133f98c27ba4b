"""Compare two labelled result sets of runs.py: `python bench/behaviour/compare.py before after [--only a,b]
[--show N]`.

For every run in out/<A>/ or out/<B>/ (sub-folders with a metrics.jsonl, or runs named in either _summary.json), it
loads metrics.jsonl (rows merged by step; a key logged twice in one step gets a '#2' suffix) and samples.jsonl when
present (sample i of the file, flattened: samples[i].completion, samples[i].messages[1].content, ...), and compares
every logged value EXCEPT the excluded keys below: numbers for exact equality (NaN equals NaN; the max |a - b| over the
differing numbers is reported too), strings (sample texts, roles) for exact equality. Per run it prints the values
compared, the values that differ (the first --show of them with both values) and the keys present on one side only;
then "compared N values over M runs, D differ". Exit status 1 when any value differs, any key is on one side only, or a
run is missing or failed (non-zero rc in _summary.json) on either side; else 0. Keys a later tree renamed are read
under their new name (RENAMED: weight_sync/* became sync/*), so trees on both sides of a rename compare.

Excluded (wall-clock, machine or throughput dependent; not behaviour), by the last path component or the whole key:
  elapsed_s, anything starting with timing_s/ or perf/ (perf/tokens_per_s, perf/peak_rss_gib: throughput, memory)
  sync/seconds, sync/bytes_per_s         (timings; sync/bytes, /buckets, /version ARE compared)
  generic patterns, so that new timing keys are caught too:
    a component that ends in '_s', '_sec', '_secs', '_seconds', '_per_s', '_per_sec'  (e.g. elapsed_s, tokens_per_s)
    a component that is or starts/ends with 'seconds', 'sec', 'secs', 'time', 'timing', 'wall', 'duration',
      'latency', 'throughput', 'rss', 'mem', 'memory' as a whole '_'-separated word (e.g. wall_time, step_time,
      peak_rss_gib, time_to_first_token)
  NOT excluded: reward/timeouts (a count of reward calls that timed out: 'timeouts' is not the word 'time').
Determinism (two full runs of a worktree of 64ad734, labels before / before2): every remaining key (3817 values over
21 runs) was identical run to run, so nothing else is excluded (--exclude REGEX drops more keys ad hoc). One source of
non-determinism was found and removed in runs.py rather than here: --agent with concurrent episodes (the default
--agent_max_concurrency 64) on HF generate differed run to run in ~1/3 of its values, rewards and sample texts
included (which requests share a generate call, and in which order, depends on thread timing, and the HF backend
draws from one torch RNG), so the agent runs use --agent_max_concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"

WORDS = {"seconds", "sec", "secs", "time", "timing", "wall", "duration", "latency", "throughput", "rss", "mem",
         "memory"}
EXACT = {"elapsed_s", "sync/seconds", "sync/bytes_per_s"}
RENAMED = {"weight_sync/": "sync/"}  # old key prefix -> new
PREFIXES = ("timing_s/", "perf/")
SUFFIXES = ("_s", "_sec", "_secs", "_seconds", "_per_s", "_per_sec")


def excluded(key: str, extra: list[re.Pattern]) -> bool:
    base = re.sub(r"#\d+$", "", key)
    if base in EXACT or base.startswith(PREFIXES) or any(p.search(base) for p in extra):
        return True
    for comp in base.split("/"):
        if comp.endswith(SUFFIXES) or WORDS & set(comp.split("_")):
            return True
    return False


def flatten(obj, prefix: str):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def load(run_dir: Path) -> dict[str, object]:
    """'step <s>/<key>' -> value for metrics.jsonl, 'samples[i]...' -> value for samples.jsonl."""
    values: dict[str, object] = {}
    with open(run_dir / "metrics.jsonl") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            step = row.pop("step", None)
            for k, v in row.items():
                k = next((new + k[len(old):] for old, new in RENAMED.items() if k.startswith(old)), k)
                for path, leaf in flatten(v, f"step {step}/{k}"):
                    key, n = path, 1
                    while key in values:
                        n += 1
                        key = f"{path}#{n}"
                    values[key] = leaf
    samples = run_dir / "samples.jsonl"
    if samples.is_file():
        with open(samples) as f:
            for i, line in enumerate(x for x in f if x.strip()):
                for path, leaf in flatten(json.loads(line), f"samples[{i}]"):
                    values[path] = leaf
    return values


def metric_name(key: str) -> str:
    """'step 3/eval/loss#2' -> 'eval/loss#2'; 'samples[4].completion' -> 'completion' (what exclusion looks at)."""
    if key.startswith("step "):
        return key.split("/", 1)[1]
    return re.sub(r"\[\d+\]", "", key.split(".", 1)[1]) if "." in key else key


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b if isinstance(a, str) or isinstance(b, str) else a == b


def numeric(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def short(v, n: int = 90) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


def summary(label: str) -> dict:
    p = OUT / label / "_summary.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument("--show", type=int, default=5, help="differing values printed per run")
    ap.add_argument("--exclude", action="append", default=[], help="regex of more keys to skip (repeatable)")
    args = ap.parse_args()
    extra = [re.compile(x) for x in args.exclude]
    sa, sb = summary(args.a), summary(args.b)

    def runs(label, s):
        d = OUT / label
        return set(s) | ({p.name for p in d.iterdir() if (p / "metrics.jsonl").is_file()} if d.is_dir() else set())

    names = sorted(runs(args.a, sa) | runs(args.b, sb))
    if args.only:
        names = [n for n in args.only.split(",") if n]
    if not names:
        print(f"no runs under {OUT / args.a} or {OUT / args.b}")
        return 1
    total_n = total_d = compared_runs = 0
    total_max = 0.0
    bad = False
    for name in names:
        problems = []
        for label, s in ((args.a, sa), (args.b, sb)):
            if name in s and s[name].get("rc") != 0:
                problems.append(f"{label}: rc={s[name].get('rc')}")
            if not (OUT / label / name / "metrics.jsonl").is_file():
                problems.append(f"{label}: missing")
        if any("missing" in p for p in problems):
            print(f"{name}: NOT COMPARED ({'; '.join(problems)})")
            bad = True
            continue
        va, vb = load(OUT / args.a / name), load(OUT / args.b / name)
        keep = lambda k: not excluded(metric_name(k), extra)  # noqa: E731
        ka, kb = {k for k in va if keep(k)}, {k for k in vb if keep(k)}
        common = sorted(ka & kb, key=lambda k: (not k.startswith("step"), k))
        diffs = [k for k in common if not same(va[k], vb[k])]
        num_diffs = [abs(va[k] - vb[k]) for k in diffs if numeric(va[k]) and numeric(vb[k])
                     and math.isfinite(va[k]) and math.isfinite(vb[k])]
        mx = max(num_diffs, default=0.0)
        only_a, only_b = sorted(ka - kb), sorted(kb - ka)
        compared_runs += 1
        total_n += len(common)
        total_d += len(diffs)
        total_max = max(total_max, mx)
        status = "OK" if not (diffs or only_a or only_b or problems) else "DIFF"
        bad |= status != "OK"
        print(f"{name}: {status}: compared {len(common)} values, {len(diffs)} differ"
              + (f" (max abs diff {mx:.3g})" if diffs else "")
              + (f"; {'; '.join(problems)}" if problems else ""))
        for k in diffs[:args.show]:
            print(f"    {k}: {short(va[k])} != {short(vb[k])}")
        if len(diffs) > args.show:
            print(f"    ... {len(diffs) - args.show} more")
        for label, only in ((args.a, only_a), (args.b, only_b)):
            if only:
                print(f"    only in {label} ({len(only)}): {', '.join(only[:8])}{' ...' if len(only) > 8 else ''}")
    print(f"compared {total_n} values over {compared_runs} runs, {total_d} differ"
          + (f" (max abs diff {total_max:.3g})" if total_d else ""))
    return 1 if bad or total_d else 0


if __name__ == "__main__":
    sys.exit(main())
