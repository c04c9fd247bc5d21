"""Run every benchmark (benchmarks/bench_*.py) in turn, then the plots.

`make bench` runs this. `--quick` passes tiny sizes to each (the smoke test
uses it). Each benchmark writes its own JSON to benchmarks/results/. bench_ray.py
(Ray Train, RayRunner and SparkRunner side by side) needs `stratkit[ray]` and
`stratkit[spark]`; without one, its rows say "not available".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("names", nargs="*", help="only these benchmarks (e.g. overhead ps)")
    args = parser.parse_args(argv)
    scripts = sorted(HERE.glob("bench_*.py"))
    if args.names:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.names]
    failed = []
    for script in scripts:
        start = time.monotonic()
        print(f"== {script.stem} ==", flush=True)
        code = subprocess.call([sys.executable, str(script)] + (["--quick"] if args.quick else []))
        print(f"== {script.stem}: exit {code} in {time.monotonic() - start:.0f}s ==", flush=True)
        if code:
            failed.append(script.stem)
    plots = HERE / "plot.py"
    if plots.exists() and not args.quick:
        subprocess.call([sys.executable, str(plots)])
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
