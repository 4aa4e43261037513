"""Run by tests/test_trainer_callbacks.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU: TrainerCallbacks on two ranks. Each rank records
its TrainerState flags and every on_log; TensorBoardCallback writes from the
world process zero only."""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import TrainerCallback, TrainingArguments
from transformers.integrations import TensorBoardCallback

from hookloop import Loop
from hookloop.adapters.transformers import TrainerCallbacks

out = Path(sys.argv[1])
os.environ["TENSORBOARD_LOGGING_DIR"] = str(out / "tb")


class Flags(TrainerCallback):
    def __init__(self):
        self.logs = []
        self.flags = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.flags = {"is_world_process_zero": state.is_world_process_zero,
                      "is_local_process_zero": state.is_local_process_zero,
                      "max_steps": state.max_steps}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({**logs, "step": state.global_step})


# TrainingArguments first: created after an Accelerator, they would reset its state
args = TrainingArguments(output_dir=str(out), report_to=[], use_cpu=True, logging_strategy="steps",
                         logging_steps=2, eval_strategy="epoch", save_strategy="no")
accelerator = Accelerator(cpu=True)
set_seed(0)
x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
evaluation = DataLoader(TensorDataset(x[:21], y[:21]), batch_size=4)
flags = Flags()
loop = Loop(model=model, optimizer=optimizer, train_data=train, eval_data=evaluation,
            plugins=[TrainerCallbacks([flags, TensorBoardCallback()], args=args)],
            accelerator=accelerator, block=["progress"])
loop.fit(epochs=2)
rank = accelerator.process_index
(out / f"rank-{rank}.json").write_text(json.dumps({
    **flags.flags, "global_step": loop.state.global_step,
    # the timing entries differ by rank; the values logged are the same
    "logs": [{k: v for k, v in log.items() if "runtime" not in k and "per_second" not in k}
             for log in flags.logs],
}))
loop.close()
