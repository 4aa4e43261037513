"""Loop with its default plugins equals the brief's hand-written loop, bit for bit."""

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

from handwritten import train_by_hand
from hookloop import Loop
from hookloop.testing import reset_accelerate

EPOCHS = 2


def mlp_job():
    set_seed(0)
    x, y = torch.randn(96, 12), torch.randint(0, 4, (96,))
    model = torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 4)
    )
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return model, data


def bert_job():
    set_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    ids = torch.randint(0, 100, (40, 16))
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(40)]
    data = DataLoader(rows, batch_size=8, shuffle=True)
    return model, data


def brief_optim(model, data):
    optimizer = torch.optim.Adam(params=model.parameters(), lr=2e-5)
    total = len(data) * EPOCHS
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    return optimizer, scheduler


def run_by_hand(job, accumulation, precision="no"):
    reset_accelerate()
    model, data = job()
    optimizer, scheduler = brief_optim(model, data)
    accelerator = Accelerator(device_placement=True, gradient_accumulation_steps=accumulation,
                              mixed_precision=precision)
    train_by_hand(accelerator, model, optimizer, data, scheduler, EPOCHS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_hookloop(job, accumulation, precision="no"):
    reset_accelerate()
    model, data = job()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = brief_optim(model, data)
    accelerator = Accelerator(device_placement=True, gradient_accumulation_steps=accumulation,
                              mixed_precision=precision)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=accelerator)
    loop.fit(epochs=EPOCHS)
    return initial, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("job", [mlp_job, bert_job], ids=["mlp", "bert"])
def test_default_loop_equals_hand_written_loop(job, accumulation):
    expected = run_by_hand(job, accumulation)
    initial, got = run_hookloop(job, accumulation)
    assert any(not torch.equal(initial[k], got[k]) for k in got), "training changed nothing"
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.parametrize("accumulation", [1, 2])
def test_bf16_mixed_precision_equals_the_hand_written_loop(accumulation):
    expected = run_by_hand(bert_job, accumulation, "bf16")
    _, got = run_hookloop(bert_job, accumulation, "bf16")
    fp32 = run_by_hand(bert_job, accumulation)
    assert any(not torch.equal(fp32[k], got[k]) for k in got), "bf16 changed nothing"
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_parity_would_catch_a_different_step():
    """The comparison is sharp: one step less than the hand-written loop differs."""
    reset_accelerate()
    model, data = mlp_job()
    optimizer, scheduler = brief_optim(model, data)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data)
    loop.fit(max_steps=EPOCHS * len(data) - 1)
    got = model.state_dict()
    expected = run_by_hand(mlp_job, 1)
    assert any(not torch.equal(expected[k], got[k]) for k in expected)
