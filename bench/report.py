"""Markdown tables of the jax_ls2 rows in benchmark CSVs (for the README):

  python -m bench.report bench/results/h200-2026-11-29
"""
import csv
import glob
import os
import sys


def rows_of(folder):
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        yield from csv.DictReader(open(path))


def main(folder):
    print("| op | shape | dtype | pass | ms | % copy BW | x XLA | device ms | device % copy BW | device x XLA |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows_of(folder):
        if not r.get("impl", "").startswith("jax_ls2"):
            continue
        impl = "" if r["impl"] == "jax_ls2" else f" ({r['impl'][8:].strip('[]')})"
        print(f"| {r['op']}{impl} | {r['shape']} | {r['dtype']} | {r['pass']} | {r['ms_median']} | "
              f"{r['pct_copy_bw']} | {r['speedup_vs_xla']} | {r.get('device_ms', '')} | "
              f"{r.get('device_pct_copy_bw', '')} | {r.get('device_speedup_vs_xla', '')} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
