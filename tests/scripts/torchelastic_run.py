"""elastic.py's run as TorchElastic runs it (tests/loop/test_torchelastic.py):
``torchrun`` starts it, restarts it after a failure (``--max-restarts``) and
on a membership change (``--nnodes=MIN:MAX``), and every start resumes from
``latest``.

    torchrun [...] torchelastic_run.py OUT --ckpt DIR [--epochs E]
        [--every-steps N] [--kill-once RANK:MICRO_STEP] [--step-sleep S]

64 examples in global batches of 16 (each process's batch: 16 / WORLD_SIZE,
as elastic jobs keep their global batch whatever the membership), the MLP,
Adam and schedule of elastic.py, its ``Recorder`` (OUT/records.jsonl: every batch's examples,
over the processes); ``Checkpoint(dir=DIR, every_steps=N)`` with the default
signals (the SIGTERM TorchElastic stops a group with is a preemption) and
``Loop(..., resume_from="latest")``. Each start appends a JSON line to
OUT/starts.jsonl (main process): the update it started at, the number of
processes, TorchElastic's restart count, the checkpoint it resumed.
``--kill-once R:K``: the process of rank R SIGKILLs itself after batch K,
the first time only (OUT/killed marks it). ``--step-sleep S``: each update
takes S seconds longer (time for a node to join). At the end the main
process writes OUT/params.pt and OUT/run.json.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic import N, Indexed, Recorder  # noqa: E402

from hookloop import Loop, hookimpl  # noqa: E402
from hookloop.plugins import Checkpoint  # noqa: E402


GLOBAL_BATCH = 16


class Faults:
    """``--kill-once`` and ``--step-sleep``, after the recorder's record."""

    name = "faults"

    def __init__(self, out: Path, kill_once: str | None, sleep: float):
        self.marker, self.sleep = out / "killed", sleep
        self.rank, self.at = map(int, kill_once.split(":")) if kill_once else (None, None)

    @hookimpl(trylast=True)
    def after_step(self, loop):
        if self.sleep:
            time.sleep(self.sleep)
        acc = loop.accelerator
        if acc.process_index == self.rank and loop.state.micro_step == self.at and not self.marker.exists():
            self.marker.write_text(json.dumps({"pid": os.getpid(), "global_step": loop.state.global_step}))
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every-steps", type=int, default=3)
    parser.add_argument("--kill-once", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    data = DataLoader(Indexed(), batch_size=GLOBAL_BATCH // accelerator.num_processes, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    total = args.epochs * (N // GLOBAL_BATCH)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4) * max(0.1, 1 - s / total))
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=[Checkpoint(dir=args.ckpt, every_steps=args.every_steps, keep_last=None),
                         Recorder(args.out / "records.jsonl"), Faults(args.out, args.kill_once, args.step_sleep)],
                accelerator=accelerator, block=["progress"], resume_from="latest")
    if accelerator.is_main_process:
        with open(args.out / "starts.jsonl", "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "num_processes": accelerator.num_processes,
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1)),
                                "resumed_from": loop.resumed_from and loop.resumed_from.name}) + "\n")
    loop.fit(epochs=args.epochs)
    if accelerator.is_main_process:
        torch.save({k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()},
                   args.out / "params.pt")
        (args.out / "run.json").write_text(json.dumps({
            "global_step": loop.state.global_step, "num_processes": accelerator.num_processes}))
    loop.close()


if __name__ == "__main__":
    main()
