"""A run that records which examples it trains on, for the elastic-resume
tests (tests/checkpointing/test_elastic.py): a checkpoint continued on
another number of processes, batch size or gradient accumulation.

    python elastic.py OUT --ckpt DIR [--batch-size B] [--accum K] [--epochs E]
                      [--max-steps N] [--kill-at BATCH] [--every-steps N]
                      [--resume PATH|latest] [--lenient] [--weights-only]
                      [--generator] [--dropout P] [--stream]

64 examples, shuffled (the default sampler; ``--generator``: a DataLoader
with a generator of its own; ``--stream``: an ``IterableDataset`` drawing its
order from the global RNG), each batch ``(x, y, index)``; an MLP (dropout
``P``, default 0), Adam, a warm-up schedule sized as Accelerate's convention
asks (``epochs * len(the unprepared loader)``), ``Checkpoint(dir=DIR,
every_steps=N)``. The ``Recorder`` plugin gathers every batch's indices over
the processes and the main process appends one JSON line per batch to
OUT/records.jsonl (epoch, step_in_epoch, global_step, micro_step, the
indices in global order, the learning rate), flushed at once, so that a run
killed with ``--kill-at`` (every rank sends itself SIGKILL in the
``after_step`` of that batch, ``micro_step``) keeps its record.

``--resume`` loads that checkpoint first (``load_checkpoint(path,
strict=not --lenient, weights_only=--weights-only)``); the warnings it gave
go to OUT/run.json, a ``CheckpointError`` to OUT/error.json (exit 3), the
weights as loaded to OUT/loaded.pt. At the end the main process writes
OUT/params.pt and OUT/run.json. Works alone or
under ``accelerate launch --multi_gpu --num_processes 2``
(``Accelerator(cpu=True)``).
"""

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, IterableDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import Checkpoint

N = 64


class Indexed(Dataset):
    """``(x, y, index)``: the supervised strategy trains on ``x, y``; the
    recorder reads the index."""

    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N, 8, generator=g)
        self.y = torch.randint(0, 3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class IndexedStream(IterableDataset):
    """The same examples without a length, in an order drawn from the global
    torch RNG at each pass (Accelerate dispatches its batches from the main
    process on several processes)."""

    def __init__(self):
        self.rows = Indexed()

    def __iter__(self):
        for i in torch.randperm(N).tolist():
            yield self.rows[i]


class Recorder:
    """The examples each batch trains, over all processes, in global order."""

    name = "recorder"

    def __init__(self, file: Path, kill_at=None):
        self.file = file
        self.kill_at = kill_at

    @hookimpl
    def after_step(self, loop, batch):
        acc = loop.accelerator
        indices = acc.gather(batch[2].to(acc.device).reshape(-1)).tolist()  # rank 0's, rank 1's ...
        state = loop.state
        if acc.is_main_process:
            optimizer = next(iter(loop.networks.values())).optimizer
            with open(self.file, "a") as f:
                f.write(json.dumps({
                    "epoch": state.epoch, "step_in_epoch": state.step_in_epoch,
                    "global_step": state.global_step, "micro_step": state.micro_step,
                    "indices": indices, "lr": optimizer.param_groups[0]["lr"],
                    "time": time.time(),  # (benchmarks/failure_cost.py: when each update ended)
                }) + "\n")
                f.flush()
                os.fsync(f.fileno())
        if self.kill_at is not None and state.micro_step == self.kill_at:
            acc.wait_for_everyone()  # (each rank's record of this batch is written)
            os.kill(os.getpid(), signal.SIGKILL)


def build(args, accelerator):
    set_seed(0)
    generator = torch.Generator().manual_seed(7) if args.generator else None
    if getattr(args, "stream", False):
        data = DataLoader(IndexedStream(), batch_size=args.batch_size)
    else:
        data = DataLoader(Indexed(), batch_size=args.batch_size, shuffle=True, generator=generator)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    # sized as Accelerate steps a prepared scheduler: once per process per update
    total = args.epochs * (N // args.batch_size) // args.accum
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * max(0.1, 1 - s / total))
    checkpoint = Checkpoint(dir=args.ckpt, every_steps=args.every_steps, keep_last=None, signals=None)
    return Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=[checkpoint, Recorder(args.out / "records.jsonl", args.kill_at)],
                accelerator=accelerator, block=["progress"])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--every-steps", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--lenient", action="store_true", help="load_checkpoint(strict=False)")
    parser.add_argument("--weights-only", action="store_true")
    parser.add_argument("--generator", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--stream", action="store_true", help="an IterableDataset without a length")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
    loop = build(args, accelerator)
    start, messages = loop.state.global_step, []
    if args.resume:
        from hookloop.checkpointing import CheckpointError

        kwargs = {"weights_only": True} if args.weights_only else {"strict": not args.lenient}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loop.load_checkpoint(args.resume, **kwargs)
            except CheckpointError as exc:
                if accelerator.is_main_process:
                    (args.out / "error.json").write_text(json.dumps({"error": str(exc)}))
                loop.close()
                sys.exit(3)
        messages = [str(w.message) for w in caught if "hookloop" in str(w.message)]
        start = loop.state.global_step
        if accelerator.is_main_process:  # the weights as loaded, before training
            torch.save({k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()},
                       args.out / "loaded.pt")
    if args.max_steps is not None:
        loop.fit(max_steps=args.max_steps)
    else:
        loop.fit(epochs=args.epochs)
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()},
                   args.out / "params.pt")
        (args.out / "run.json").write_text(json.dumps({
            "started_at": start, "global_step": loop.state.global_step,
            "micro_step": loop.state.micro_step, "epoch": loop.state.epoch,
            "num_processes": accelerator.num_processes,
            "run_id": getattr(getattr(loop.state, "run", None), "id", None),
            "resumed_from": str(loop.resumed_from), "warnings": messages,
            "lr": loop.networks["model"].optimizer.param_groups[0]["lr"],
        }))
    loop.close()


if __name__ == "__main__":
    main()
