"""Two processes that disagree: ``stop`` (rank 0 alone calls loop.stop() at
update 3), ``reduce`` (rank 0 alone runs a collective at update 3), or
``ungathered`` (a metric plugin returns each process's own values, not
gathered: every process would compute another mean).

    accelerate launch --multi_gpu --num_processes 2 disagree_two_processes.py OUT MODE

Each rank writes OUT/rank-<r>.json (where it stopped, why, or the error and
its notes)."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl


class Ungathered:
    @hookimpl
    def after_eval_step(self, outputs):
        return {"eval_mine": outputs.float().mean(-1)}  # no gather_for_metrics


class Disagree:
    def __init__(self, mode):
        self.mode = mode

    @hookimpl
    def after_step(self, loop):
        acc = loop.accelerator
        if loop.state.global_step == 3 and acc.sync_gradients and acc.is_main_process:
            if self.mode == "stop":
                loop.stop("rank 0 had enough")
            else:
                acc.reduce(torch.ones(3), reduction="sum")  # the other rank never joins


def main(out, mode):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data = DataLoader(TensorDataset(torch.randn(256, 8), torch.randint(0, 3, (256,))), batch_size=8)
    plugins = [Ungathered()] if mode == "ungathered" else [Disagree(mode)]
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
                eval_data=DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=8),
                accelerator=accelerator, plugins=plugins, block=["progress"])
    try:
        loop.fit(epochs=1)  # 16 updates an epoch per process
        result = {"global_step": loop.state.global_step, "stop_reason": loop.state.stop_reason}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}", "notes": getattr(exc, "__notes__", [])}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(result))
    loop.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
