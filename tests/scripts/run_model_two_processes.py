"""Run by tests/test_distributed.py under `accelerate launch --multi_gpu
--num_processes 2` on CPU: evaluation every N updates and predict see each
example exactly once over the two ranks; then a second Loop in the same
script (a cross-validation fold) trains, because closing the first kept the
process group."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl

out = Path(sys.argv[1])


class SeenIds:
    """The example ids each evaluation saw, gathered over the ranks."""

    def __init__(self):
        self.evaluations = []

    @hookimpl
    def on_eval_start(self, loop):
        if loop.state.stage == "eval":  # not the sanity check (stage "sanity")
            self.evaluations.append([])

    @hookimpl
    def after_eval_step(self, loop, batch):
        if loop.state.stage == "eval":
            self.evaluations[-1].extend(loop.accelerator.gather_for_metrics(batch[2]).tolist())


def fold(seed):
    set_seed(seed)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    ids = torch.arange(21)
    evald = DataLoader(TensorDataset(x[:21], y[:21], ids), batch_size=4)  # uneven: 21 = 2*4*2 + 5
    return model, optimizer, train, evald, x


class RankValuesOk:
    """loop.log(on_epoch=True) of values that differ by rank: reduced over both."""

    @hookimpl
    def after_step(self, loop):
        rank = float(loop.accelerator.process_index)
        loop.log({"rank_mean": torch.tensor(rank)}, on_step=False, on_epoch=True)
        loop.log({"rank_max": rank}, on_step=False, on_epoch=True, reduce="max")
        if rank == 1:
            loop.log({"only_on_one": 7.0}, on_step=False, on_epoch=True)


accelerator = Accelerator(cpu=True)
model, optimizer, train, evald, x = fold(0)
seen = SeenIds()
loop = Loop(model=model, optimizer=optimizer, train_data=train, eval_data=evald,
            accelerator=accelerator, plugins=[seen, RankValuesOk()], block=["progress"])
epoch_metrics = loop.fit(epochs=2, eval_every=3)  # 4 updates an epoch per rank: at 3, 4 (epoch end), 6, 8
predicted = loop.predict(DataLoader(TensorDataset(x[:21]), batch_size=4))
plain = loop.networks["model"].unwrapped
plain.eval()
with torch.no_grad():
    expected = plain(x[:21])

# per-token outputs: sequences as long as their batch of 4 says, so the two
# processes' batches (0, 2, 4 and 1, 3, 5) differ in length at every step
lengths = [3, 5, 2, 6, 4, 7]
tokens = [torch.randn(lengths[i // 4], 8) for i in range(21)]


def pad_batch(rows):
    longest = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(longest - len(r), 8)]) for r in rows])


ragged = loop.predict(DataLoader(tokens, batch_size=4, collate_fn=pad_batch))
with torch.no_grad():
    ragged_expected = torch.full((21, max(lengths), 3), -100.0)
    for i, seq in enumerate(tokens):
        ragged_expected[i, :len(seq)] = plain(seq)
report = {
    "num_processes": accelerator.num_processes,
    "evaluations": [sorted(e) for e in seen.evaluations],
    "eval_lengths": [len(e) for e in seen.evaluations],
    "predict_shape": list(predicted.shape),
    "predict_matches": bool(torch.allclose(predicted, expected, atol=1e-5)),
    "ragged_shape": list(ragged.shape),
    "ragged_padding_matches": bool(torch.equal(ragged == -100, ragged_expected == -100)),
    "ragged_values_match": bool(torch.allclose(ragged, ragged_expected, atol=1e-5)),
    "first_global_step": loop.state.global_step,
    "epoch_values": {k: epoch_metrics[k] for k in ("rank_mean", "rank_max", "only_on_one")},
}
loop.close()

# a second fold in the same script, a fresh Accelerator: needs the process group
second = Accelerator(cpu=True)
model, optimizer, train, evald, _ = fold(1)
loop = Loop(model=model, optimizer=optimizer, train_data=train, eval_data=evald,
            accelerator=second, block=["progress"])
metrics = loop.fit(epochs=1)
report.update(second_global_step=loop.state.global_step, second_metrics=sorted(metrics),
              params=[p.detach().sum().item() for p in model.parameters()])
(out / f"run-model-{accelerator.process_index}.json").write_text(json.dumps(report))
