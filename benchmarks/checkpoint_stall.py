"""How long a checkpoint stalls training: hookloop's synchronous and
asynchronous ``Checkpoint`` against a hand-written loop calling
``accelerator.save_state``, Lightning's ``ModelCheckpoint`` and
pytorch-accelerated's ``SaveTrainingStateCallback``, on the same model; then
one save and one load, each against Accelerate's, on a quiet machine and
with another process keeping one core busy.

    python benchmarks/checkpoint_stall.py [--repeats 5] [--threads 1] [--dir DIR]
                                          [--variants a,b,...] [--no-table]

The model: six ``Linear(1024, 1024)`` (ReLU between) with Adam, ~25 M floats
of weights and state (~100 MB a checkpoint), batches of 64 random rows, a
mean-square loss; 61 updates, a save after every 10th (6 saves), one CPU
thread (``--threads``).

Method:

- **Fresh process per measurement** (``--worker VARIANT``), **interleaved**:
  each repeat runs every variant once, the order reversed every other repeat.
- **Each step timed inside the process** (wall clock: a background writer's
  work on another core is not training time, its competition for the cores
  is): a timestamp at every batch start, so a step's time includes its
  update's saving. 60 steps are measured (update 61 and the fit's end are
  not: the fit-end save of hookloop, and its wait for a background save).
- **The saving step's excess** over the process's median step: what a save
  blocks training for (wall clock), and the same in CPU time of the
  training thread (``time.thread_time``: what the save costs that thread
  itself, steadier when other processes share the cores). **Every save
  counts**, as a user pays them: the first save apart (it allocates what
  the later ones reuse: the host buffers of an asynchronous save; the
  allocator's arenas for the others), the mean of the 5 others (the second
  included: a save that waits for the previous one's background write
  shows there), and the mean of all 6; each as a ratio to the hand-written
  loop's ``save_state`` in the same repeat (first to first, mean to mean).
  The median of saves 2-6 (the steady figure, which hides one slow save a
  run) is printed beside them, and every save's excess: per save, and each
  repeat's list.
- **All steps' excess per save**: the excess of all 60 steps over the
  process's own median step, per save, minus the same excess of the run of
  the same loop without saves in that repeat (its jitter): what saving
  costs training, including the slow-down a background writer causes to the
  steps after a save. (The difference of two processes' total times is not
  used: their median steps differ by up to ±20 % on a shared machine, ten
  times a save.)
- Medians over repeats, lowest–highest in brackets; the load average
  before and after is printed with the table.

The peers run only if they import (``pip install -e '.[bench]'``;
pytorch-accelerated saves with Accelerate's ``save_state``, the oldest
beyond two deleted, as ``Checkpoint(keep_last=2)`` here). Lightning: ``--lightning-path DIR`` adds a
folder it was installed into with ``pip install --no-deps --target DIR
lightning pytorch-lightning lightning-utilities torchmetrics``, which keeps
the environment's torch).

The save/load rows (one process, the model after training): a synchronous
``checkpointing.save`` with every check (fsync included; compared with
the durable ``save_state``: the same plus an fsync of each file),
Accelerate's ``save_state`` (no fsync) and that durable one;
``checkpointing.load`` (every file's size and CRC-32, finiteness) against
``accelerator.load_state``; what an asynchronous save does at the safe
point (Accelerate's small files and ``writer.host_copy``; its
finiteness check runs in the writer). Interleaved repeats, each with its
ratio to the Accelerate row it replaces.
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
#: --device cuda (benchmarks/gpu_check.sh): the model on the GPU, a device sync at each stamp
CUDA = os.environ.get("HOOKLOOP_BENCH_DEVICE", "cpu").startswith("cuda")
UPDATES, EVERY, WIDTH, LAYERS, BATCH = 61, 10, 1024, 6, 64
MEASURED = 60
VARIANTS = ["hand-nosave", "hand-save_state", "hookloop-nosave", "hookloop-sync", "hookloop-async",
            "lightning-nosave", "lightning-ckpt", "ptacc-nosave", "ptacc-ckpt"]
BASELINE = {"hand-save_state": "hand-nosave", "hookloop-sync": "hookloop-nosave",
            "hookloop-async": "hookloop-nosave", "lightning-ckpt": "lightning-nosave",
            "ptacc-ckpt": "ptacc-nosave"}
LABELS = {"hand-save_state": "hand-written loop + accelerator.save_state",
          "hookloop-sync": "hookloop Checkpoint (synchronous)",
          "hookloop-async": "hookloop Checkpoint(asynchronous=True)",
          "lightning-ckpt": "Lightning ModelCheckpoint",
          "ptacc-ckpt": "pytorch-accelerated SaveTrainingStateCallback"}
#: the peers' variants, and what they need importable
PEERS = {"lightning": "lightning.pytorch", "ptacc": "pytorch_accelerated"}


def build(seed=0):
    import torch

    torch.manual_seed(seed)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    x = torch.randn(UPDATES * BATCH, WIDTH)
    y = torch.randn(UPDATES * BATCH, WIDTH)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), data


def worker(variant: str, out: Path, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    stamps, cpu = [], []
    kind, saves = variant.split("-", 1)

    def stamp():
        if CUDA:
            torch.cuda.synchronize()  # (a step's time, not its launch's)
        stamps.append(time.perf_counter())
        cpu.append(time.thread_time())

    if kind == "hand":
        from accelerate import Accelerator

        acc = Accelerator(cpu=not CUDA)
        model, optimizer, data = build()
        model, optimizer, data = acc.prepare(model, optimizer, data)
        for step, (x, y) in enumerate(data, 1):
            stamp()
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if saves == "save_state" and step % EVERY == 0:
                acc.save_state(str(out / f"step_{step}"))
    elif kind == "hookloop":
        from accelerate import Accelerator

        from hookloop import Loop, hookimpl
        from hookloop.plugins import Checkpoint

        class Stamps:
            @hookimpl
            def before_step(self):
                stamp()

            @hookimpl
            def compute_loss(self, outputs, batch):
                return torch.nn.functional.mse_loss(outputs, batch[1])

        plugins = [Stamps()]
        if saves != "nosave":
            plugins.append(Checkpoint(dir=out, every_steps=EVERY, every_epoch=False, keep_last=2,
                                      signals=None, asynchronous=saves == "async"))
        model, optimizer, data = build()
        loop = Loop(model=model, optimizer=optimizer, train_data=data, plugins=plugins,
                    accelerator=Accelerator(cpu=not CUDA), block=["progress", "finite"])
        loop.fit(max_steps=UPDATES)
        loop.close()
    elif kind == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import Callback, ModelCheckpoint

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model, self._optimizer, self.data = build()

            def training_step(self, batch, i):
                return torch.nn.functional.mse_loss(self.model(batch[0]), batch[1])

            def configure_optimizers(self):
                return self._optimizer

        class Stamps(Callback):
            def on_train_batch_start(self, *args):
                stamp()

        callbacks = [Stamps()]
        if saves == "ckpt":
            callbacks.append(ModelCheckpoint(dirpath=out, every_n_train_steps=EVERY, save_top_k=-1))
        module = Module()
        trainer = pl.Trainer(max_steps=UPDATES, accelerator="gpu" if CUDA else "cpu", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=saves == "ckpt", callbacks=callbacks,
                             num_sanity_val_steps=0)
        trainer.fit(module, module.data)
    elif kind == "ptacc":
        from pytorch_accelerated import Trainer
        from pytorch_accelerated.callbacks import SaveTrainingStateCallback, TrainerCallback
        from pytorch_accelerated.trainer import DEFAULT_CALLBACKS

        class PtStamps(TrainerCallback):
            def on_train_step_start(self, trainer, **kwargs):
                stamp()

        callbacks = [*DEFAULT_CALLBACKS, PtStamps()]
        if saves == "ckpt":  # (Accelerate's save_state underneath, the oldest beyond 2 deleted)
            callbacks.append(SaveTrainingStateCallback(save_dir=str(out), save_every_n_steps=EVERY,
                                                       save_at_end=False, max_checkpoints=2))
        model, optimizer, data = build()
        trainer = Trainer(model=model, loss_func=torch.nn.functional.mse_loss, optimizer=optimizer,
                          callbacks=callbacks)
        trainer.train(train_dataset=data.dataset, num_epochs=1, per_device_batch_size=BATCH,
                      train_dataloader_kwargs={"shuffle": False, "num_workers": 0})

    def excess(stamps):
        steps = [b - a for a, b in zip(stamps, stamps[1:])][:MEASURED]
        saving = [steps[i - 1] for i in range(EVERY, MEASURED + 1, EVERY)]
        median = statistics.median(t for i, t in enumerate(steps, 1) if i % EVERY)
        return steps, median, [(t - median) * 1e3 for t in saving]

    steps, median, saving = excess(stamps)
    _, cpu_median, cpu_saving = excess(cpu)
    return {"variant": variant, "total_s": sum(steps), "median_step_ms": median * 1e3,
            "excess_ms": saving, "saves": len(saving),
            "all_excess_ms": (sum(steps) - len(steps) * median) * 1e3,
            "cpu_excess_ms": cpu_saving}


def save_load_rows(out: Path, threads: int, repeat: int = 5, busy: bool = False) -> list:
    """One process: a save and a load of the trained model, each against
    Accelerate's; ``busy``: while another process keeps one core busy."""
    import torch
    from accelerate import Accelerator

    from hookloop import Loop, checkpointing, hookimpl
    from hookloop.checkpointing import accelerate as accel
    from hookloop.checkpointing import store as layout, writer

    torch.set_num_threads(threads)

    class Loss:
        @hookimpl
        def compute_loss(self, outputs, batch):
            return torch.nn.functional.mse_loss(outputs, batch[1])

    model, optimizer, data = build()
    loop = Loop(model=model, optimizer=optimizer, train_data=data, plugins=[Loss()],
                accelerator=Accelerator(cpu=not CUDA), block=["progress", "finite"])
    loop.fit(max_steps=2)
    acc = loop.accelerator
    counter = iter(range(10_000))

    def timed(fn):  # interleaved by the caller: one call of each, repeat times
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def hookloop_save():
        return checkpointing.save(loop, out / "hl", reason="bench", name=f"step-{next(counter):08d}",
                                  keep_last=1)

    def accelerate_save(fsync=False):
        folder = out / "acc" / str(next(counter))
        acc.save_state(str(folder))
        if fsync:
            for file in folder.iterdir():
                layout.fsync_file(file)
            layout.fsync_dir(folder)

    def host():
        folder = Path(tempfile.mkdtemp(dir=out))
        heavy = accel.heavy_states(acc, folder)
        accel.save_small_files(acc, folder)
        writer.host_copy(acc, heavy).release(acc)

    host()  # (the first copy allocates the host buffers the next ones reuse)
    # (a root of its own: the saves timed below rotate theirs)
    path = checkpointing.save(loop, out / "hl-load", reason="bench", name="step-00000000")
    plain = out / "acc" / "load"
    acc.save_state(str(plain))
    # label, what it does, the Accelerate row it is compared with
    ops = [("save: hookloop, every check, fsync (synchronous)", hookloop_save,
            "save: accelerator.save_state + fsync of each file"),
           ("save: accelerator.save_state (no fsync)", accelerate_save, None),
           ("save: accelerator.save_state + fsync of each file", lambda: accelerate_save(True), None),
           ("stall of an asynchronous save: small files + host copy", host,
            "save: accelerator.save_state (no fsync)"),
           ("load: hookloop (sizes, CRC-32, finiteness, then commit)",
            lambda: checkpointing.load(loop, path), "load: accelerator.load_state"),
           ("load: accelerator.load_state", lambda: acc.load_state(str(plain)), None)]
    times = {label: [] for label, *_ in ops}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        time.sleep(0.5 if busy else 0)
        for r in range(repeat):
            for label, fn, _ in (ops if r % 2 == 0 else ops[::-1]):
                times[label].append(timed(fn))
    finally:
        if hog is not None:
            hog.kill()
    size = sum(p.stat().st_size for p in path.iterdir())
    loop.close()
    return [{"row": label, "ms": times[label], "versus": versus, "mb": size / 1e6}
            for label, _, versus in ops]


def run_worker(args, variant, out) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if variant.startswith("lightning") and args.lightning_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.lightning_path, env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--dir", str(out),
           "--threads", str(args.threads), "--device", args.device]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importable(module, path) -> bool:
    env = {**os.environ}
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env,
                          capture_output=True).returncode == 0


def fmt(values, scale=1.0):
    values = [v * scale for v in values]
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--lightning-path", default=os.environ.get("HOOKLOOP_LIGHTNING_PATH"))
    parser.add_argument("--no-table", action="store_true", help="skip the save/load rows")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: the model's device")
    parser.add_argument("--worker", default=None)
    args = parser.parse_args(argv)
    os.environ["HOOKLOOP_BENCH_DEVICE"] = args.device  # (the workers read it)
    global CUDA
    CUDA = args.device.startswith("cuda")
    if args.worker in ("save-load", "save-load-busy"):
        print(json.dumps(save_load_rows(args.dir, args.threads, max(args.repeats, 5),
                                        busy=args.worker.endswith("busy"))))
        return 0
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.threads)))
        return 0
    variants = args.variants.split(",")
    for peer, module in PEERS.items():
        if any(v.startswith(peer) for v in variants) and not importable(module, args.lightning_path):
            print(f"{module} is not importable: its rows are left out (pip install -e '.[bench]'; "
                  "Lightning: see --lightning-path)")
            variants = [v for v in variants if not v.startswith(peer)]
    results = {v: [] for v in variants}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            for v in order:
                out = Path(scratch) / f"{v}-{r}"
                out.mkdir()
                results[v].append(run_worker(args, v, out))
                print(f"repeat {r + 1}/{args.repeats} {v}: {results[v][-1]['total_s']:.2f} s", file=sys.stderr)
        tables = {}
        if not args.no_table:
            for kind in ("save-load", "save-load-busy"):
                out = Path(scratch) / kind
                out.mkdir()
                tables[kind] = run_worker(args, kind, out)
    load_after = os.getloadavg()
    print(f"\nCheckpoint stall: {LAYERS} x Linear({WIDTH}, {WIDTH}) + Adam, {MEASURED} timed updates, "
          f"a save every {EVERY} ({MEASURED // EVERY} saves a run); {args.repeats} interleaved repeats (fresh "
          f"processes), {args.threads} thread(s); load average {load_before[0]:.1f} before, {load_after[0]:.1f} "
          f"after ({os.cpu_count()} CPUs); ms, median over repeats (lowest–highest)\n")
    print("- a save's excess: the step that saves, over the process's median step (wall clock): what the "
          "save blocks training for. Every save counts: the first (it allocates what the later ones reuse, "
          "and an asynchronous save's writer may still be starting) apart, then the mean of the others (the "
          "second included: what a user pays per save), and the mean of every save.")
    print("- × save_state's: the same figure of the hand-written loop's `accelerator.save_state` in the same "
          "repeat (the first against its first, a mean against its mean), median over repeats.")
    print("- median of saves 2-: the steady figure (what earlier versions of this benchmark reported).")
    print("- its training-thread CPU: the mean of every save's excess in CPU time of the training thread "
          "(what the save itself costs that thread; steadier than wall time on a shared machine).")
    print("- all steps' excess per save: every step's excess over the median, per save, minus the "
          "no-save run's: includes the slow-down a background writer causes to the steps after a "
          "save (noisy: a repeat's jitter can exceed a save).\n")
    stall = {}
    for v, base in BASELINE.items():
        if v not in results or base not in results:
            continue
        n = results[v][0]["saves"]
        stall[v] = [(a["all_excess_ms"] - b["all_excess_ms"]) / n for a, b in zip(results[v], results[base])]
    figures = {  # name -> per repeat, from a run's list of every save's excess
        "first": lambda saves: saves[0],
        "later": lambda saves: statistics.mean(saves[1:]),
        "every": lambda saves: statistics.mean(saves),
        "median later": lambda saves: statistics.median(saves[1:]),
    }

    def versus(v, figure):  # per repeat, the ratio to save_state's same figure
        if "hand-save_state" not in results:
            return ""
        ratios = [figures[figure](a["excess_ms"]) / figures[figure](b["excess_ms"])
                  for a, b in zip(results[v], results["hand-save_state"]) if figures[figure](b["excess_ms"]) > 0]
        return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else ""

    print("| variant | step without saves | first save | × save_state's | mean of saves 2- | × save_state's "
          "| mean of every save | × save_state's | median of saves 2- | its training-thread CPU | all steps' "
          "excess per save |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v in stall:
        steps = [b["median_step_ms"] for b in results[BASELINE[v]]]
        cells = []
        for figure in ("first", "later", "every"):
            cells += [fmt([figures[figure](x["excess_ms"]) for x in results[v]]), versus(v, figure)]
        cells.append(fmt([figures["median later"](x["excess_ms"]) for x in results[v]]))
        cells.append(fmt([statistics.mean(x["cpu_excess_ms"]) for x in results[v]]))
        print(f"| {LABELS[v]} | {fmt(steps)} | {' | '.join(cells)} | {fmt(stall[v])} |")
    n = max(results[v][0]["saves"] for v in stall) if stall else 0
    print("\nEvery save's excess (ms), median over repeats (lowest–highest):\n")
    print("| variant | " + " | ".join(f"save {i + 1}" for i in range(n)) + " |")
    print("|---|" + "---:|" * n)
    for v in stall:
        print(f"| {LABELS[v]} | " + " | ".join(fmt([x["excess_ms"][i] for x in results[v]]) for i in range(n))
              + " |")
    print("\nEvery save's excess (ms), each repeat:\n")
    for v in stall:
        for r, x in enumerate(results[v], 1):
            print(f"- {LABELS[v]}, repeat {r}: " + ", ".join(f"{t:.0f}" for t in x["excess_ms"]))
    for kind, rows in tables.items():
        n = len(rows[0]["ms"])
        print(f"\nOne save / one load of that model ({rows[0]['mb']:.0f} MB of files; in the page cache), "
              f"one process{', another keeping one core busy' if kind.endswith('busy') else ''}, {n} "
              "interleaved repeats, ms, median (lowest–highest):\n")
        print("| operation | ms | × Accelerate's |")
        print("|---|---:|---:|")
        by_label = {row["row"]: row["ms"] for row in rows}
        for row in rows:
            versus = ""
            if row["versus"] in by_label:
                ratios = [a / b for a, b in zip(row["ms"], by_label[row["versus"]]) if b > 0]
                versus = (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) of "
                          f"{row['versus'].split(': ', 1)[1]}")
            print(f"| {row['row']} | {fmt(row['ms'])} | {versus} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
