"""Runs every GPU test (marker ``gpu``) in several processes and says where the time went.

    python -m bench.gpu_tests --out DIR [--workers N] [--timeout S] [-k EXPR] [paths...]

One pytest session over the test files, spread over ``--workers`` processes: through
pytest-xdist's ``worksteal`` scheduler where it is installed (each worker starts with a
contiguous run of tests and idle workers take from busy ones), else as N pytest processes
that each keep every N-th GPU test (``JAX_LS2_TEST_SHARD``). The XLA compiles that
dominate the suite run on the host, so the workers are sized to the cores, and no worker
preallocates GPU memory.

Writes to DIR: ``gpu_tests.log`` (or one log per shard), JUnit XML, and
``gpu_tests_profile.csv``: per worker, its start-up, collection, tracing, lowering and
backend-compile seconds, its compile count, and its wall time. Prints the counts, the
profile's sums, the slowest tests and the files by time. Exits 1 if any test failed or
errored, or no GPU test ran; 2 if the time limit cut the run.
"""
from __future__ import annotations

import argparse
import csv
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

PROFILE_FIELDS = ["name", "startup_s", "collect_s", "trace_s", "lower_s", "backend_compile_s", "compiles", "wall_s"]


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _pytest_cmd(paths, k_expr, junit):
    cmd = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-q", "-p", "no:cacheprovider", "--junitxml", junit,
           "-o", "junit_family=xunit1"]
    return cmd + (["-k", k_expr] if k_expr else [])


def run(out, workers, timeout, k_expr, paths):
    """(returncode, seconds): the suite run as the module docstring says."""
    profile_dir = os.path.join(out, "gpu_tests_profile")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_LS2_TEST_PROFILE=profile_dir,
               JAX_LS2_TEST_T0=repr(time.time()), PYTHONUNBUFFERED="1")
    t0 = time.time()
    if importlib.util.find_spec("xdist") is not None:
        cmd = _pytest_cmd(paths, k_expr, os.path.join(out, "gpu_tests.xml"))
        cmd += ["-n", str(workers), "--dist", "worksteal"]
        with open(os.path.join(out, "gpu_tests.log"), "w") as log:
            try:
                code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = None
        return code, time.time() - t0
    procs = []
    for i in range(workers):
        log = open(os.path.join(out, f"gpu_tests_shard{i}.log"), "w")
        cmd = _pytest_cmd(paths, k_expr, os.path.join(out, f"gpu_tests_shard{i}.xml"))
        procs.append((subprocess.Popen(cmd, env=dict(env, JAX_LS2_TEST_SHARD=f"{i}/{workers}"), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    code = 0
    for p, log in procs:
        try:
            rc = p.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = None
        log.close()
        code = None if rc is None or code is None else max(code, rc)
    return code, time.time() - t0


def results(out):
    """(counts, per-test rows (file, name, seconds, outcome)) from the JUnit XML files."""
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    tests = []
    for path in sorted(glob.glob(os.path.join(out, "gpu_tests*.xml"))):
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
            counts[outcome] += 1
            tests.append((case.get("file") or case.get("classname", ""), case.get("name", ""),
                          float(case.get("time") or 0.0), outcome))
    return counts, tests


def profiles(out):
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "gpu_tests_profile", "*.json"))):
        with open(path) as f:
            rows.append(json.load(f))
    if rows:
        with open(os.path.join(out, "gpu_tests_profile.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=PROFILE_FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return rows


def summary(code, seconds, counts, tests, prof, workers):
    lines = [f"gpu tests: {counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
             f"{counts['skipped']} skipped in {seconds:.0f} s wall on {workers} workers"
             + (" (TIME LIMIT)" if code is None else "")]
    if prof:
        tot = {k: sum(float(r.get(k) or 0) for r in prof) for k in PROFILE_FIELDS[1:]}
        lines.append(f"  worker seconds: start-up {tot['startup_s']:.0f}, collection {tot['collect_s']:.0f}, "
                     f"tracing {tot['trace_s']:.0f}, lowering {tot['lower_s']:.0f}, XLA compiles "
                     f"{tot['backend_compile_s']:.0f} ({tot['compiles']:.0f} compiles), wall {tot['wall_s']:.0f}; "
                     f"the rest (running, checking, float64 truths) {tot['wall_s'] - sum(tot[k] for k in PROFILE_FIELDS[1:6]):.0f}")
    by_file = {}
    for file, _, secs, _ in tests:
        by_file[file] = by_file.get(file, 0.0) + secs
    if by_file:
        lines.append("  test seconds by file: " + ", ".join(
            f"{os.path.basename(f)} {s:.0f}" for f, s in sorted(by_file.items(), key=lambda x: -x[1])[:8]))
        slow = sorted(tests, key=lambda t: -t[2])[:5]
        lines.append("  slowest: " + ", ".join(f"{n} {s:.1f} s" for _, n, s, _ in slow))
    for file, name, _, outcome in tests:
        if outcome in ("failed", "errors"):
            lines.append(f"  {outcome.upper()}: {file}::{name}")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole suite")
    p.add_argument("-k", dest="k_expr", default="", help="pytest -k expression")
    p.add_argument("paths", nargs="*", default=["tests"])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    code, seconds = run(args.out, args.workers, args.timeout, args.k_expr, args.paths)
    counts, tests = results(args.out)
    lines = summary(code, seconds, counts, tests, profiles(args.out), args.workers)
    print("\n".join(lines))
    with open(os.path.join(args.out, "gpu_tests_summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if code is None:
        sys.exit(2)
    if counts["failed"] or counts["errors"] or not counts["passed"] or code not in (0, 5):
        sys.exit(1)


if __name__ == "__main__":
    main()
