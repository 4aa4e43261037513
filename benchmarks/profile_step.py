"""Where a loop's per-step time goes, by package (cProfile, 1 thread).

    python benchmarks/profile_step.py                 # hand-written vs hookloop
    python benchmarks/profile_step.py --top 25        # and the top functions
    python benchmarks/profile_step.py --workload gan --variants hand,hookloop-nofast \\
        --top 20 --package hookloop                   # hookloop's own functions

Each variant runs in a fresh process (as in overhead.py). cProfile inflates
small Python functions, so read the split between packages and the ranking,
not the absolute µs: overhead.py measures those.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGES = ("hookloop", "pluggy", "tqdm", "accelerate", "torch", "importlib", "inspect")


def _package(filename: str) -> str:
    if filename.startswith("<hookloop hook"):
        return "hookloop"
    for name in PACKAGES:
        if f"/{name}/" in filename or f"<frozen {name}" in filename or filename.endswith(f"/{name}.py"):
            return name
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins (C)"
    return "other python"


def worker(workload: str, variant: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import workloads as W

    set_seed(0)
    work = W.Workload(workload, quick=False)
    clock = W.EpochClock("cpu")
    profiler = cProfile.Profile()
    profiler.enable()
    if variant == "hand":
        W.run_hand(work, clock, Accelerator(cpu=True))
    elif variant == "plain":
        W.run_plain(work, clock, "cpu")
    else:
        W.run_hookloop(work, clock, Accelerator(cpu=True), variant)
    profiler.disable()
    steps = work.batches * work.epochs
    stats = pstats.Stats(profiler)
    by_package: dict = {}
    functions = []
    for (filename, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
        pkg = _package(filename)
        by_package[pkg] = by_package.get(pkg, 0.0) + tt
        functions.append((tt / steps * 1e6, nc / steps, f"{pkg}: {Path(filename).name}:{line}({func})"))
    functions.sort(reverse=True)
    Path(out).write_text(json.dumps({
        "by_package": {k: v / steps * 1e6 for k, v in by_package.items()},
        "functions": functions,
    }))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mlp", help="mlp (default), bert or gan")
    parser.add_argument("--variants", default="hand,hookloop")
    parser.add_argument("--top", type=int, default=0, help="also list the top N functions")
    parser.add_argument("--package", default=None, help="list only functions of this package")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.workload, args.worker, args.result)
        return 0
    variants = args.variants.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            out = Path(tmp) / f"{v}.json"
            import workloads as W

            env = {**os.environ, "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1"}
            env.update(W.VARIANTS.get(v, {}).get("env", {}))
            subprocess.run([sys.executable, __file__, "--worker", v, "--workload", args.workload,
                            "--result", str(out)],
                           check=True, env=env, capture_output=True)
            results[v] = json.loads(out.read_text())
    packages = sorted({p for r in results.values() for p in r["by_package"]})
    print("µs per step under cProfile (own time), by package\n")
    print("| package | " + " | ".join(variants) + " |")
    print("|---|" + "---:|" * len(variants))
    for p in packages:
        print(f"| {p} | " + " | ".join(f"{results[v]['by_package'].get(p, 0):.1f}" for v in variants) + " |")
    print("| **total** | " + " | ".join(f"{sum(results[v]['by_package'].values()):.1f}" for v in variants) + " |")
    if args.top:
        for v in variants:
            print(f"\ntop {args.top} functions, {v} (µs per step, calls per step)")
            functions = [f for f in results[v]["functions"]
                         if args.package is None or f[2].startswith(args.package + ":")]
            for us, calls, name in functions[: args.top]:
                print(f"  {us:7.2f} {calls:5.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
