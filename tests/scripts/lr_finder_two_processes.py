"""Run by tests/loop/test_lr_finder.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU: the learning-rate finder on two ranks whose
batches differ sees one curve (each update's loss averaged over the ranks),
stops at the same update on both when the loss diverges (a rank stopping
alone would hang the other in DDP's all-reduce), and a fit after it ends
bitwise where the fit without it ends."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.plugins import GradClip

out = Path(sys.argv[1])


def build():
    set_seed(0)
    x = torch.randn(128, 8)
    y = (x @ torch.randn(8, 3)).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.05 * s))
    return Loop(model=model, optimizer=opt, scheduler=sched, plugins=[GradClip(max_norm=5.0)],
                train_data=DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
                accelerator=Accelerator(cpu=True), block=["progress"])


def params(loop):
    return [p.detach().clone() for p in loop.networks["model"].unwrapped.parameters()]


loop = build()
assert loop.accelerator.num_processes == 2
loop.fit(max_steps=3)  # mid-epoch: 8 updates an epoch per rank
result = loop.find_lr(min_lr=1e-5, max_lr=1e3, num_training=80)  # diverges before the end
loop.fit(epochs=2)
swept = params(loop)
rank = loop.accelerator.process_index
loop.close()

loop = build()
loop.fit(max_steps=3)
loop.fit(epochs=2)
plain = params(loop)
loop.close()

(out / f"lr-{rank}.json").write_text(json.dumps({
    "lrs": result.lrs, "losses": result.losses, "stopped": result.stopped,
    "suggestion": result.suggestion, "same_fit": all(torch.equal(a, b) for a, b in zip(swept, plain)),
}))
torch.save(swept, out / f"params-{rank}.pt")
