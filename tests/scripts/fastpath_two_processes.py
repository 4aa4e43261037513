"""Run by tests/test_accelerate_fastpath.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU (gloo, DDP-wrapped model).

For gradient accumulation 1 and 2, each rank trains the same job twice on the
same Accelerator: once with the reference workload's hand-written loop, once with a
hookloop Loop (whose Accelerate fast path is on), then writes what the test
compares to OUT/rank-<r>.json.
"""

import json
import sys
from pathlib import Path

import accelerate.optimizer
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the hand-written loop
from handwritten import train_by_hand  # noqa: E402

from hookloop import Loop  # noqa: E402

EPOCHS = 2
out = Path(sys.argv[1])


def job():
    set_seed(0)
    x, y = torch.randn(80, 6), torch.randint(0, 3, (80,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 3))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 5 batches per rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / 40)
    return model, optimizer, data, scheduler


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


lookups = 0
original = accelerate.optimizer.is_lomo_available


def counting():
    global lookups
    lookups += 1
    return original()


report = {}
for accumulation in (1, 2):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, optimizer, data, scheduler = job()
    hand = flat(train_by_hand(accelerator, model, optimizer, data, scheduler, EPOCHS))

    model, optimizer, data, scheduler = job()
    initial = flat(model)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=accelerator, block=["progress"])
    lookups = 0
    accelerate.optimizer.is_lomo_available = counting  # what AcceleratedOptimizer.step asks
    loop.fit(epochs=EPOCHS)
    accelerate.optimizer.is_lomo_available = original
    mine = flat(loop.networks["model"].unwrapped)
    gathered = accelerator.gather(mine[None]).cpu()
    report[str(accumulation)] = {
        "equal_to_hand": bool(torch.equal(hand, mine)),
        "trained": not torch.equal(initial, mine),
        "ranks_agree": bool(torch.equal(gathered[0], gathered[1])),
        "accelerate_lookups": lookups,
        "fast_step": loop.fastpath.is_fast(loop.networks["model"].optimizer),
        "plain_backward": loop.fastpath.plain_backward,
        "ddp": type(loop.networks["model"].model).__name__,
    }
    # the loops close at exit (hookloop.Loop.close drops the prepared objects
    # first: gloo otherwise aborts at exit now and then)
    del model, optimizer, data, scheduler

report["num_processes"] = accelerator.num_processes
(out / f"rank-{accelerator.process_index}.json").write_text(json.dumps(report))
accelerator.wait_for_everyone()
