"""One replica group of one process training with ``FaultTolerant()``, for
benchmarks/failure_cost.py (test_torchft.py runs the README's ``train.py``):

    TORCHFT_LIGHTHOUSE=... REPLICA_GROUP_ID=G NUM_REPLICA_GROUPS=2 \\
        python ft_run.py OUT --max-steps N [--step-sleep S] [--kill-at K]

or, for a group of several processes, ``torchrun [--max-restarts=1] ...
ft_run.py ...`` (``--kill-at K``: its rank 1 SIGKILLs itself after update K,
once).

256 examples, each group its share (``replica_share``) in batches of 8, an MLP,
Adam, a schedule. OUT/records.jsonl: one line per batch (the update, the position
in the epoch and the examples of the batch, the groups taking part, the updates
discarded so far, the time); OUT/params.pt and
OUT/run.json at the end. No ``Checkpoint``: a recovering group can only heal
from its peer.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import hookloop_torchft
from hookloop import Loop, hookimpl


class Record:
    def __init__(self, file: Path, sleep: float, inputs: torch.Tensor, kill_at: int | None):
        self.file, self.sleep, self.inputs, self.kill_at = file, sleep, inputs, kill_at

    @hookimpl
    def after_step(self, loop, batch):
        ft = loop.plugins.get("fault-tolerant")
        indices = [int((self.inputs == row).all(1).nonzero()[0]) for row in batch[0]]  # which examples
        with open(self.file, "a") as f:
            f.write(json.dumps({"global_step": loop.state.global_step, "micro_step": loop.state.micro_step,
                                "epoch": loop.state.epoch, "step_in_epoch": loop.state.step_in_epoch,
                                "indices": indices,
                                "participants": ft.manager.num_participants(),
                                "discarded": loop.discarded_updates, "time": time.time(),
                                "rank": loop.accelerator.process_index}) + "\n")
        marker = self.file.parent / "killed"
        if loop.accelerator.process_index == 1 and loop.state.global_step == self.kill_at and not marker.exists():
            marker.write_text(str(self.kill_at))
            os.kill(os.getpid(), signal.SIGKILL)  # (under torchrun --max-restarts: the group restarts)
        time.sleep(self.sleep)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself after this update, once")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    dataset = TensorDataset(torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g))
    data = DataLoader(dataset, batch_size=8, sampler=hookloop_torchft.replica_share(dataset))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
    from datetime import timedelta

    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                plugins=[hookloop_torchft.FaultTolerant(timeout=timedelta(seconds=10)),
                         Record(args.out / "records.jsonl", args.step_sleep, dataset.tensors[0], args.kill_at)],
                accelerator=Accelerator(cpu=True), block=["progress"])
    started = time.time()
    loop.fit(max_steps=args.max_steps)
    if not loop.accelerator.is_main_process:
        loop.close()
        return
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / "params.pt")
    (args.out / "run.json").write_text(json.dumps({
        "global_step": loop.state.global_step, "discarded": loop.discarded_updates,
        "manager_step": loop.plugins.get("fault-tolerant").manager.current_step(),
        "seconds": time.time() - started}))
    loop.close()


if __name__ == "__main__":
    main()
