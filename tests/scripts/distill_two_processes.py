"""Distil a small teacher into a student in two processes and report whether
the ranks agree and the teacher stayed frozen.

Launched by tests/test_distillation.py with ``accelerate launch --multi_gpu
--num_processes 2 ... distill_two_processes.py OUT.json``; the main process
writes the JSON report.
"""

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.strategies import Distillation


class Watch:
    name = "watch"

    def __init__(self):
        self.steps = 0
        self.seen = 0
        self.evaluations = []  # examples seen by each evaluation, gathered over ranks

    @hookimpl
    def after_optimizer_step(self, network):
        assert network.name == "student"
        self.steps += 1

    @hookimpl
    def on_eval_start(self):
        self.seen = 0

    @hookimpl
    def after_eval_step(self, loop, outputs):
        self.seen += loop.accelerator.gather_for_metrics(outputs).shape[0]

    @hookimpl
    def on_eval_end(self, loop):
        if loop.state.stage == "eval":  # not the sanity check (stage "sanity")
            self.evaluations.append(self.seen)


def mlp(hidden):
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(hidden, 3))


def main(out):
    accelerator = Accelerator(cpu=True)  # without cpu=True, --multi_gpu on a CPU runs two lone processes
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    teacher, student = mlp(32), mlp(8)
    teacher_before = [p.detach().clone() for p in teacher.parameters()]
    student_before = [p.detach().clone() for p in student.parameters()]
    watch = Watch()
    loop = Loop(
        networks={"teacher": Network(teacher, None),
                  "student": Network(student, torch.optim.Adam(student.parameters(), lr=1e-2))},
        strategy=Distillation(temperature=2.0, alpha=0.5),
        train_data=DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
        eval_data=DataLoader(TensorDataset(x[:24], y[:24]), batch_size=8),
        plugins=[watch], accelerator=accelerator, block=["progress"],
    )
    metrics = loop.fit(epochs=2)

    def rows(values):  # one row per rank
        return accelerator.gather(torch.tensor(values, dtype=torch.float64).reshape(1, -1))

    flat = torch.cat([p.detach().reshape(-1) for p in loop.networks["student"].unwrapped.parameters()])
    student_rows = accelerator.gather(flat.reshape(1, -1))
    unchanged = all(torch.equal(a, b) for a, b in zip(loop.networks["teacher"].unwrapped.parameters(),
                                                      teacher_before))
    wrapped = [isinstance(loop.networks[n].model, DistributedDataParallel) for n in ("teacher", "student")]
    per_rank = rows([unchanged, *wrapped, watch.steps]).tolist()
    report = {
        "num_processes": accelerator.num_processes,
        "student_identical_across_ranks": bool(torch.equal(student_rows[0], student_rows[-1])),
        "student_trained": not all(torch.equal(a, b) for a, b in zip(
            loop.networks["student"].unwrapped.parameters(), student_before)),
        "teacher_unchanged": [bool(r[0]) for r in per_rank],
        "teacher_wrapped": [bool(r[1]) for r in per_rank],
        "student_wrapped": [bool(r[2]) for r in per_rank],
        "optimizer_steps": [int(r[3]) for r in per_rank],
        "eval_examples": watch.evaluations,
        "eval_accuracy": metrics["eval_accuracy"],
    }
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump(report, f)
    loop.close()


if __name__ == "__main__":
    main(sys.argv[1])
