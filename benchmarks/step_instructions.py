"""Instructions per training step, per loop variant, counted by callgrind.

    python benchmarks/step_instructions.py                        # mlp: plain, hand, hookloop
    python benchmarks/step_instructions.py --workloads mlp,bert --top 15
    python benchmarks/step_instructions.py --variants plain,hookloop,hookloop-nofinite

CPU time on a machine shared with other programs moves by several per cent
from run to run; the number of instructions a step executes does not (two
runs of one variant agree to ~0.01 %). Each variant runs in a fresh process
under ``valgrind --tool=callgrind`` with instrumentation off; after the
warm-up epochs the workload's clock (the same ``EpochClock`` hook points as
``overhead.py``: one call at an epoch's start and end) switches it on, and at
the end of the last epoch it dumps the counts. The window is whole epochs, so
per-epoch work (a new dataloader iterator, hookloop's epoch hooks) is spread
over its steps as it is in ``overhead.py``.

The switch is callgrind's client requests (``valgrind/callgrind.h``), built
once into a small shared library with the system C compiler and called
through ``ctypes``.

Printed per workload: instructions per step per variant and the excess over
``plain`` (and, at the ``--ns-per-instruction`` given, a rough µs figure);
the excess split by shared object (Python's interpreter, torch, libc ...);
with ``--top N``, the functions whose per-step count differs most between
each variant and ``plain``. Python-level attribution is by ablation
(variants that leave one default plugin or one mechanism out, see
``workloads.VARIANTS``) and ``profile_step.py``. Under valgrind, torch sees
no AVX-512 and runs its AVX2 kernels: the model's own count is not the
native one, but it is the same in every variant.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: epochs per process: warm-up (uninstrumented), then counted
EPOCHS = {"mlp": (1, 2), "bert": (1, 1), "gan": (1, 2), "empty": (1, 2)}
DEFAULT_VARIANTS = "plain,hand,hookloop"

_HELPER = r"""
#include <valgrind/callgrind.h>
void hl_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void hl_stop(void) { CALLGRIND_DUMP_STATS_AT("window"); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_helper(folder: Path) -> Path:
    """The client-request library, compiled into ``folder``."""
    source, lib = folder / "hl_callgrind.c", folder / "hl_callgrind.so"
    source.write_text(_HELPER)
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("step_instructions.py needs a C compiler (cc) to build callgrind's client requests")
    proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(source)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"could not build the callgrind helper (is valgrind's callgrind.h "
                         f"installed?):\n{proc.stderr[-2000:]}")
    return lib


class WindowClock:
    """The benchmark loops' clock: counting on from the first timed epoch's
    start to the last epoch's end."""

    def __init__(self, lib: str, warmup: int, epochs: int):
        self._lib = ctypes.CDLL(lib)
        self._warmup, self._epochs = warmup, epochs
        self._started = self._stopped = 0
        self.seconds: list[float] = []

    def start(self):
        if self._started == self._warmup:
            self._lib.hl_start()
        self._started += 1

    def stop(self):
        self._stopped += 1
        if self._stopped == self._epochs:
            self._lib.hl_stop()


def worker(workload: str, variant: str, lib: str, result: str) -> None:
    import torch

    torch.set_num_threads(1)
    import workloads as W

    if variant != "plain":
        from accelerate import Accelerator
    if variant.startswith("hookloop"):
        import hookloop  # noqa: F401

    W.seed_everything(0)
    work = W.Workload(workload, quick=False)
    warmup, counted = EPOCHS[workload]
    work.epochs = warmup + counted  # the schedule's length stays the workload's
    clock = WindowClock(lib, warmup, work.epochs)
    if variant == "plain":
        models = W.run_plain(work, clock, "cpu")
    else:
        accelerator = Accelerator(cpu=True)
        if variant == "hand":
            models = W.run_hand(work, clock, accelerator)
        else:
            models, _ = W.run_hookloop(work, clock, accelerator, variant)
    Path(result).write_text(json.dumps({"steps": work.batches * counted,
                                        "params": W.params_digest(models)}))


_LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*?)(?:\s+\[(.*)\])?$")


def read_counts(dump: Path) -> dict:
    """``{(object, function): instructions}`` of one callgrind dump, each
    function's own (exclusive) count."""
    proc = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dump)],
                          capture_output=True, text=True, check=True)
    counts: dict = {}
    body = False
    for line in proc.stdout.splitlines():
        if "file:function" in line:
            body = True
            continue
        if not body:
            continue
        m = _LINE.match(line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        where = m.group(2)
        function = where.rsplit(":", 1)[-1] if ":" in where else where
        obj = Path(m.group(3)).name if m.group(3) else "?"
        counts[(obj, function)] = counts.get((obj, function), 0) + n
    return counts


def measure(workload: str, variant: str, lib: Path, tmp: Path) -> dict:
    import workloads as W

    out = tmp / f"cg.{workload}.{variant}"
    result = tmp / f"{workload}-{variant}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1",
           "OMP_NUM_THREADS": "1"}
    env.update(W.VARIANTS.get(variant, {}).get("env", {}))
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           sys.executable, str(Path(__file__).resolve()), "--worker", workload, variant,
           "--lib", str(lib), "--result", str(result)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{variant} failed under callgrind:\n{proc.stderr[-3000:]}")
    dumps = sorted(tmp.glob(f"cg.{workload}.{variant}.*"))
    window = [d for d in dumps if "window" in d.read_text(errors="replace")[:2000]]
    if not window:
        raise RuntimeError(f"{workload}/{variant}: no counted window in {dumps}")
    counts = read_counts(window[0])
    info = json.loads(result.read_text())
    steps = info["steps"]
    return {"per_step": sum(counts.values()) / steps, "steps": steps, "params": info["params"],
            "functions": {f"{o}|{f}": n / steps for (o, f), n in counts.items()}}


def _objects(functions: dict) -> dict:
    by: dict = {}
    for key, n in functions.items():
        obj = key.split("|", 1)[0]
        obj = re.sub(r"\.so[.\d]*$", "", obj)
        by[obj] = by.get(obj, 0.0) + n
    return by


def report(workload: str, results: dict, top: int, ns: float | None) -> str:
    lines = [f"\n**{workload}** (callgrind, instructions per step, "
             f"{next(iter(results.values()))['steps']} counted steps)\n"]
    base = results.get("plain")
    head = "| variant | instructions/step | × plain | excess over plain |"
    head += " ≈ µs at %.2f ns/instr |" % ns if ns else ""
    lines += [head, "|---|---:|---:|---:|" + ("---:|" if ns else "")]
    for variant, r in results.items():
        row = f"| {variant} | {r['per_step']:,.0f} |"
        if base is not None and variant != "plain":
            extra = r["per_step"] - base["per_step"]
            row += f" {r['per_step'] / base['per_step']:.4f} | {extra:+,.0f} |"
            row += f" {extra * ns / 1000:+.1f} |" if ns else ""
        else:
            row += " — | — |" + (" — |" if ns else "")
        lines.append(row)
    digests = {r["params"] for r in results.values()}
    lines.append(f"\nparameters bitwise equal in every variant: {'yes' if len(digests) == 1 else 'NO'}")
    if base is None:
        return "\n".join(lines)
    objects = {v: _objects(r["functions"]) for v, r in results.items()}
    names = sorted({o for by in objects.values() for o in by},
                   key=lambda o: -max(abs(by.get(o, 0) - objects["plain"].get(o, 0))
                                      for by in objects.values()))
    others = [v for v in results if v != "plain"]
    lines += ["\nexcess over plain by shared object (instructions per step)\n",
              "| object | plain | " + " | ".join(others) + " |",
              "|---|---:|" + "---:|" * len(others)]
    for o in names[:8]:
        p = objects["plain"].get(o, 0)
        lines.append(f"| {o} | {p:,.0f} | "
                     + " | ".join(f"{objects[v].get(o, 0) - p:+,.0f}" for v in others) + " |")
    if top:
        for v in others:
            f, pf = results[v]["functions"], base["functions"]
            diff = {k: f.get(k, 0) - pf.get(k, 0) for k in set(f) | set(pf)}
            ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]
            lines.append(f"\n{v} − plain: top {top} functions (instructions per step)\n")
            lines += [f"    {d:+10,.0f}  {k.split('|', 1)[1]}  [{k.split('|', 1)[0]}]" for k, d in ranked]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mlp", help="comma-separated: mlp, bert, gan, empty")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated (default {DEFAULT_VARIANTS}); see workloads.VARIANTS")
    parser.add_argument("--top", type=int, default=0, help="list the N functions that differ most")
    parser.add_argument("--ns-per-instruction", type=float, default=None,
                        help="also show the excess as µs at this many ns per instruction")
    parser.add_argument("--out", default=None, help="also write the report here")
    parser.add_argument("--json", default=None, help="write the raw per-function counts here")
    parser.add_argument("--keep", default=None,
                        help="keep callgrind's dumps in this folder (for callgrind_annotate --tree=caller)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--lib", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.lib, args.result)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        parser.error("valgrind (with callgrind_annotate) is not installed")
    text, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lib = build_helper(tmp)
        for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
            results = {}
            for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
                results[variant] = measure(workload, variant, lib, tmp)
                print(f"  {workload} {variant}: {results[variant]['per_step']:,.0f} instructions/step",
                      file=sys.stderr)
            raw[workload] = results
            text.append(report(workload, results, args.top, args.ns_per_instruction))
            if args.keep:
                Path(args.keep).mkdir(parents=True, exist_ok=True)
                for dump in tmp.glob(f"cg.{workload}.*"):
                    shutil.copy(dump, args.keep)
    out = "\n".join(text) + "\n"
    print(out)
    if args.out:
        Path(args.out).write_text(out)
    if args.json:
        Path(args.json).write_text(json.dumps(raw))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
