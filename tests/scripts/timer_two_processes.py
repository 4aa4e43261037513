"""Run by tests/test_lightning_callbacks.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU: the two ranks' clocks disagree (rank 1's runs three
times faster), and the Timer still stops both at the same update, the one the
main process's clock decides."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import hookloop.plugins.timer as timer_module
from hookloop import Loop
from hookloop.plugins import LambdaCallback, Timer

out = Path(sys.argv[1])
accelerator = Accelerator(cpu=True)
rank = accelerator.process_index


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


clock = Clock()
timer_module._now = clock  # this process's own clock
step = 1.0 if rank == 0 else 3.0
tick = LambdaCallback(name="tick", after_step=lambda: setattr(clock, "now", clock.now + step))

set_seed(0)
x, y = torch.randn(128, 8), torch.randint(0, 3, (128,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            train_data=DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
            plugins=[tick, Timer(duration={"seconds": 5}, check_every=1)], accelerator=accelerator,
            block=["progress"])
loop.fit(epochs=3)  # 8 updates an epoch on each rank
(out / f"timer-{rank}.json").write_text(json.dumps(
    {"global_step": loop.state.global_step, "stop_reason": loop.state.stop_reason}))
loop.close()
