"""torch.compile: a compiled model trains under hookloop without a graph break
caused by the loop, bit for bit like the hand-written loop with the same
compiled model (inductor on the CPU: it needs a C compiler)."""

import shutil

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from handwritten import train_by_hand
from hookloop import Loop
from hookloop.testing import reset_accelerate

pytestmark = pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")),
    reason="torch.compile's inductor backend needs a C compiler on the CPU, and none is installed",
)


def job():
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 3))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, data, scheduler


def test_a_compiled_model_trains_like_the_hand_written_loop_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, optimizer, data, scheduler = job()
    reset_accelerate()
    train_by_hand(Accelerator(), torch.compile(model, fullgraph=True), optimizer, data, scheduler, 2)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}

    torch._dynamo.reset()
    counters.clear()
    model, optimizer, data, scheduler = job()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reset_accelerate()
    # fullgraph=True: any graph break in the model's forward would raise
    loop = Loop(model=torch.compile(model, fullgraph=True), optimizer=optimizer,
                scheduler=scheduler, train_data=data)
    loop.fit(epochs=2)
    assert set(loop.evaluate(data)) == {"eval_loss", "eval_accuracy"}  # eval mode: compiled too
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1  # it really ran compiled
    got = model.state_dict()
    assert any(not torch.equal(initial[k], got[k]) for k in got)
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
