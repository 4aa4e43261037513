"""hookloop's overhead against the hand-written Accelerate loop (and plain PyTorch).

    python benchmarks/overhead.py                 # the full table, ~5 minutes on 2 cores
    python benchmarks/overhead.py --quick         # a smoke run: few steps, 1 repeat
    python benchmarks/overhead.py --out table.md  # also write the table to a file
    python benchmarks/overhead.py --device cuda --workloads bert

Method (more in benchmarks/README.md):

- every measurement is a fresh process (``python overhead.py --worker ...``),
  with ``torch.set_num_threads(1)``, the same seed, the same data;
- per repeat, every variant of a workload runs once, in an order that
  alternates (A B C, C B A, A B C, ...), so that slow drift of a shared
  machine's load falls on every variant alike;
- a process trains ``1 + N`` epochs; the first is a warm-up; its time per step
  is the median over the N timed epochs, read as process CPU time on the CPU
  (robust to other programs' load) and as wall time after a device sync on
  CUDA (``--clock`` chooses);
- a variant's time is the median over repeats; a ratio is the median over
  repeats of that repeat's ratio, with the lowest and highest shown;
- peak memory is the process's peak resident set size (``ru_maxrss``): what
  the machine has to provide, imports included; "in training" subtracts the
  RSS before training; on CUDA also ``torch.cuda.max_memory_allocated``;
- "params ==" compares a SHA-256 of the final parameters' bytes with the
  hand-written loop's, in every repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: variants per workload; "hand" is the reference of every ratio
WORKLOADS = {
    "mlp": ["plain", "hand", "hookloop", "hookloop-nofast", "hookloop-log", "hookloop-noop10",
            "ignite", "ptacc", "lightning"],
    # the fast path saves ~0.1 ms of a 25 ms step here: not worth the minute
    "bert": ["plain", "hand", "hookloop", "ignite", "ptacc", "lightning"],
    # BERT-base: a GPU workload (gpu_check.sh); seconds a step on one CPU thread: not by default
    "bert-base": ["plain", "hand", "hookloop"],
    "gan": ["plain", "hand", "hookloop", "hookloop-nofast"],
    # the loops' own cost in µs; not in the default run (--workloads empty)
    "empty": ["plain", "hand", "hookloop", "hookloop-nofast"],
}
DEFAULT = ("mlp", "bert", "gan")
#: the smoke run exercises every code path, not every comparison
QUICK_WORKLOADS = {
    "mlp": ["plain", "hand", "hookloop", "hookloop-log", "hookloop-noop10", "ignite", "ptacc", "lightning"],
    "bert": ["hand", "hookloop"],
    "gan": ["hand", "hookloop"],
}
LABELS = {
    "plain": "plain PyTorch",
    "hand": "hand-written Accelerate",
    "hookloop": "hookloop, defaults",
    "hookloop-nofast": "hookloop, defaults, fast path off",
    "hookloop-log": "hookloop + Logger(every=50) + progress bar",
    "hookloop-noop10": "hookloop + 10 no-op plugins",
    # the peers (peers.py): their own loops on the same objects
    "ignite": "PyTorch-Ignite (create_supervised_trainer)",
    "ptacc": "pytorch-accelerated Trainer",
    "lightning": "Lightning Trainer",
    # on a GPU (benchmarks/gpu_check.sh): both loops in bf16, fp16 (GradScaler), compiled
    "hand-bf16": "hand-written Accelerate, bf16", "hookloop-bf16": "hookloop, bf16",
    "hand-fp16": "hand-written Accelerate, fp16", "hookloop-fp16": "hookloop, fp16",
    "hand-compile": "hand-written Accelerate, torch.compile", "hookloop-compile": "hookloop, torch.compile",
}
PEERS = ("ignite", "ptacc", "lightning")


# -- one measurement (a fresh process) ----------------------------------------------


def worker(workload: str, variant: str, device: str, quick: bool, clock: str, result: str) -> None:
    import resource

    deterministic = device.startswith("cuda") and os.environ.get("BENCH_NONDETERMINISTIC") != "1"
    if deterministic:  # else GPU kernels that add up in a varying order hide bitwise equality
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    torch.set_num_threads(1)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    import workloads as W

    if variant not in ("plain", *PEERS):  # plain PyTorch: Accelerate not even imported
        from accelerate import Accelerator
    if variant.startswith("hookloop"):
        import hookloop  # noqa: F401 - imported before the memory baseline
    if variant in PEERS:  # imported first, as a script does (importing pytorch_accelerated draws
        import importlib  # from torch's generator)

        import peers

        importlib.import_module(peers.MODULES[variant])

    W.seed_everything(0)
    work = W.Workload(workload, quick, deterministic)
    rss_before = _rss_mib()  # imports done, model and data built
    clock = W.EpochClock(device, clock)
    started = time.perf_counter()
    plugins = None
    if variant == "plain":
        models = W.run_plain(work, clock, device)
    elif variant in PEERS:  # (pytorch-accelerated makes its own Accelerator)
        import peers

        models = peers.run(variant, work, clock, device)
    else:
        accelerator = Accelerator(cpu=device == "cpu", **W.accelerator_options(variant))
        if variant.startswith("hand"):
            models = W.run_hand(work, clock, accelerator)
        else:
            models, plugins = W.run_hookloop(work, clock, accelerator, variant)
    wall = time.perf_counter() - started
    timed = clock.seconds[work.warmup:]
    steps = work.batches
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    out = {
        "us_per_step": statistics.median(t / steps * 1e6 for t in timed),
        "epochs_timed": len(timed),
        "steps_per_epoch": steps,
        "peak_rss_mib": peak,
        "training_rss_mib": peak - rss_before,
        "cuda_peak_mib": (
            torch.cuda.max_memory_allocated() / 2**20 if torch.device(device).type == "cuda" else None
        ),
        "params": W.params_digest(models),
        "wall_s": wall,
        "plugins": plugins,
    }
    Path(result).write_text(json.dumps(out))


def _rss_mib() -> float:
    """The resident set size now (Linux), else 0."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(workload, variant, device, quick, clock, tmp) -> dict:
    """Run one worker process and return what it measured."""
    import workloads as W

    Path(tmp).mkdir(parents=True, exist_ok=True)
    result = Path(tmp) / f"{workload}-{variant}.json"
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    # installed plugins that autoload would make the numbers depend on the machine
    env["HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env.update(W.VARIANTS.get(variant, {}).get("env", {}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", workload, variant,
           "--device", device, "--clock", clock, "--result", str(result)]
    cmd += ["--quick"] if quick else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{workload}/{variant} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(result.read_text())


# -- the table ----------------------------------------------------------------------


def run_all(workloads, repeats, device, quick, clock, jobs=1, log=print) -> dict:
    """``{workload: {variant: [result per repeat]}}``, interleaved; with
    ``jobs > 1`` (smoke runs only) several processes at once."""
    tasks = []
    for workload, variants in workloads.items():
        for r in range(repeats):
            order = variants if r % 2 == 0 else list(reversed(variants))
            tasks += [(workload, variant, r) for variant in order]
    results = {w: {v: [None] * repeats for v in variants} for w, variants in workloads.items()}
    with tempfile.TemporaryDirectory() as tmp:

        def one(task):
            workload, variant, r = task
            res = measure(workload, variant, device, quick, clock, Path(tmp) / str(r))
            results[workload][variant][r] = res
            log(f"  {workload:4} {variant:16} repeat {r + 1}/{repeats}: "
                f"{res['us_per_step']:9.1f} µs/step")

        if jobs > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(one, tasks))
        else:
            for task in tasks:
                one(task)
    return results


def _median_of(runs, ref, f):
    """Median over repeats of ``f(run, reference run)``."""
    return statistics.median(f(a, b) for a, b in zip(runs, ref))


def _row(variant, runs, hand, plain, cuda):
    us = statistics.median(r["us_per_step"] for r in runs)
    twin = hand is not None and variant != "hand"
    row = [LABELS[variant], f"{us:.1f}"]
    for ref, is_ref in ((hand, variant == "hand"), (plain, variant == "plain")):
        if ref is None or is_ref:
            row.append("—")
            continue
        ratios = [a["us_per_step"] / b["us_per_step"] for a, b in zip(runs, ref)]
        spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
        row.append(f"{statistics.median(ratios):.3f}{spread}")
    row.append(f"{statistics.median(r['peak_rss_mib'] for r in runs):.1f}")
    if twin:
        base = statistics.median(h["peak_rss_mib"] for h in hand)
        extra = _median_of(runs, hand, lambda a, b: a["peak_rss_mib"] - b["peak_rss_mib"])
        train = _median_of(runs, hand, lambda a, b: a["training_rss_mib"] - b["training_rss_mib"])
        row += [f"{extra:+.1f} ({extra / base:+.1%})", f"{train:+.1f}"]
        if cuda:
            row.append(f"{_median_of(runs, hand, lambda a, b: a['cuda_peak_mib'] - b['cuda_peak_mib']):+.2f}")
        same = sum(a["params"] == b["params"] for a, b in zip(runs, hand))
        row.append(("yes" if same == len(runs) else "**NO**") + f" ({same}/{len(runs)})")
    else:
        row += ["—", "—"] + (["—"] if cuda else []) + ["—"]
    return row


def table(results, device, repeats, quick, clock) -> str:
    """The markdown table, one block per workload."""
    lines = []
    for workload, by_variant in results.items():
        hand, plain = by_variant.get("hand"), by_variant.get("plain")
        first = next(iter(by_variant.values()))[0]
        cuda = first["cuda_peak_mib"] is not None
        lines.append(
            f"\n**{workload}** ({first['steps_per_epoch']} steps/epoch × {first['epochs_timed']} "
            f"timed epochs, {repeats} repeat(s), {device}, {clock} time)\n"
        )
        head = ["variant", "µs/step", "× hand-written", "× plain", "peak RSS MiB",
                "extra peak vs hand", "extra in training MiB"]
        head += ["extra CUDA peak MiB"] if cuda else []
        head += ["params == hand"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + [":---:"]) + "|")
        for variant, runs in by_variant.items():
            import workloads as W

            ref = None if variant.startswith("hand") and variant != "hand" else by_variant.get(W.twin(variant))
            lines.append("| " + " | ".join(_row(variant, runs, ref, plain, cuda)) + " |")
        if "hookloop" in by_variant:
            lines.append(f"\nhookloop, defaults: plugins {', '.join(by_variant['hookloop'][0]['plugins'])}")
        noop, base = by_variant.get("hookloop-noop10"), by_variant.get("hookloop")
        if noop and base:
            per = _median_of(noop, base, lambda a, b: (a["us_per_step"] - b["us_per_step"]) / 10)
            lines.append(f"\nno-op plugins: {per:.2f} µs per plugin per step "
                         "(each implements every hook and takes all its arguments)")
    note = (
        "\nµs/step: median over repeats of each process's median epoch; × ratios: median of "
        "per-repeat ratios (lowest–highest). Peak RSS: ru_maxrss of the whole process (imports included); "
        "extra in training: the same, less the RSS before training (imports done, model and "
        "data built). hookloop defaults: Loop(model, optimizer, scheduler, train_data) as a "
        "user gets it, with the built-in default plugins listed under each table (stderr "
        "is a pipe, not a terminal: the progress plugin prints its plain lines, a line "
        "every tenth of the run); "
        "installed-plugin autoload off."
    )
    if device.startswith("cuda"):
        note += (" CUDA: deterministic kernels (torch.use_deterministic_algorithms, "
                 "CUBLAS_WORKSPACE_CONFIG, eager BERT attention) in every variant, so that "
                 "parameters can be compared bit for bit; --nondeterministic turns that off.")
    if quick:
        note += " QUICK RUN: too few steps for the numbers to mean anything."
    return "\n".join(lines) + "\n" + note + "\n"


def machine() -> str:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    import accelerate

    try:
        import hookloop
        hv = hookloop.__version__
    except ImportError:
        hv = "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu} ({os.cpu_count()} cores){gpu}; torch {torch.__version__}, accelerate "
            f"{accelerate.__version__}, hookloop {hv}, Python {platform.python_version()}; "
            f"load average at start {load:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps, 1 repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="default 6 (quick: 1)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None,
                        help="time per step as process CPU time (default on cpu: robust to "
                             "a shared machine's load) or wall time (default, and forced, on cuda)")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, from {','.join(WORKLOADS)} "
                             f"(default {','.join(DEFAULT)})")
    parser.add_argument("--variants", default=None,
                        help="comma-separated: only these variants of each workload (default: all)")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="on CUDA, keep the default (non-deterministic) kernels: faster, "
                             "but parameters may then differ between any two runs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes at once (default 1; quick: 2). Timings need 1.")
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.clock is None or args.device != "cpu":
        args.clock = "cpu" if args.device == "cpu" else "wall"
    if args.nondeterministic:
        os.environ["BENCH_NONDETERMINISTIC"] = "1"  # the workers read it
    if args.worker:
        worker(*args.worker, args.device, args.quick, args.clock, args.result)
        return 0

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
    chosen = QUICK_WORKLOADS if args.quick else WORKLOADS
    names = DEFAULT
    if args.workloads:
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in names if w not in WORKLOADS]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    chosen = {w: chosen.get(w, WORKLOADS[w]) for w in names}
    chosen = {w: [v for v in vs if _available(w, v)] for w, vs in chosen.items()}
    if args.variants:
        only = {v.strip() for v in args.variants.split(",")}
        chosen = {w: [v for v in vs if v in only] for w, vs in chosen.items()}
    repeats = args.repeats or (1 if args.quick else 6)
    header = f"hookloop overhead benchmark — {machine()}"
    print(header, file=sys.stderr)
    started = time.perf_counter()
    jobs = args.jobs or (2 if args.quick else 1)
    results = run_all(chosen, repeats, args.device, args.quick, args.clock, jobs,
                      log=lambda s: print(s, file=sys.stderr))
    text = f"{header}\n" + table(results, args.device, repeats, args.quick, args.clock)
    print(text)
    print(f"(took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _available(workload, variant) -> bool:
    """Skip what this checkout cannot run yet, or this machine lacks, saying so."""
    if variant in PEERS:
        import importlib.util

        import peers

        if importlib.util.find_spec(peers.MODULES[variant].split(".")[0]) is None:
            print(f"note: {peers.MODULES[variant]} is not installed: {LABELS[variant]} skipped "
                  "(pip install pytorch-ignite pytorch-accelerated lightning)", file=sys.stderr)
            return False
    if workload == "gan" and variant.startswith("hookloop"):
        try:
            from hookloop.strategies import GAN  # noqa: F401
        except ImportError:
            print("note: hookloop.strategies.GAN not found: GAN hookloop variants skipped",
                  file=sys.stderr)
            return False
    return True


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
