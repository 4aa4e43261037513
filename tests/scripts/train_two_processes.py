"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU. Trains a tiny supervised Loop with gradient
clipping and logging, then each rank saves what the test compares."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import GradClip, Logger
from hookloop.trackers import JSONLinesTracker

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True, log_with=[JSONLinesTracker("train", out)])
set_seed(0)
x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
eval_data = DataLoader(TensorDataset(x[:21], y[:21]), batch_size=8)  # uneven last batch


class CountEval:
    """Counts the evaluation examples this rank sees after gathering."""

    def __init__(self):
        self.seen = 0

    @hookimpl
    def after_eval_step(self, loop, batch):
        if loop.state.stage == "eval":  # not the sanity check's batch
            self.seen += len(loop.accelerator.gather_for_metrics(batch[1]))


counter = CountEval()
loop = Loop(model=model, optimizer=optimizer, train_data=data, eval_data=eval_data,
            accelerator=accelerator, plugins=[GradClip(max_norm=1.0), Logger(every=2), counter])
loop.fit(epochs=2)
rank = accelerator.process_index
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"params-{rank}.pt")
(out / f"rank-{rank}.json").write_text(json.dumps({
    "num_processes": accelerator.num_processes,
    "global_step": loop.state.global_step,
    "eval_examples_seen": counter.seen,
}))
