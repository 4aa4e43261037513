"""Loop with its default plugins equals the reference workload's hand-written loop, bit for bit."""

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


# -- the 0.2 run model against hand-written loops -------------------------------------


def train_by_hand_updates(accelerator, model, optimizer, dataloader, scheduler, max_updates):
    """The hand-written loop that counts optimizer updates (Lightning's and the
    Trainer's ``global_step``) and stops after ``max_updates`` of them."""
    model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)
    updates = 0
    while updates < max_updates:
        model.train()
        for inputs, targets in dataloader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                updates += 1
                if updates == max_updates:
                    break
    return accelerator.unwrap_model(model)


@pytest.mark.parametrize("max_steps", [1, 5, 7])  # 12 batches an epoch: 6 updates
def test_accumulation_2_with_max_steps_counts_updates_like_the_hand_written_loop(max_steps):
    reset_accelerate()
    model, data = mlp_job()
    optimizer, scheduler = brief_optim(model, data)
    expected = train_by_hand_updates(Accelerator(gradient_accumulation_steps=2), model, optimizer,
                                     data, scheduler, max_steps).state_dict()
    reset_accelerate()
    model, data = mlp_job()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer, scheduler = brief_optim(model, data)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=Accelerator(gradient_accumulation_steps=2))
    loop.fit(max_steps=max_steps)
    assert loop.state.global_step == max_steps and loop.state.micro_step == 2 * max_steps
    got = model.state_dict()
    adam_steps = {int(s["step"]) for s in optimizer.state.values()}
    assert adam_steps == {max_steps}  # (the first update has a warm-up learning rate of 0)
    if max_steps > 1:
        assert any(not torch.equal(initial[k], got[k]) for k in got), "fit(max_steps) trained nothing"
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def eval_by_hand(accelerator, model, data):
    model.eval()
    losses, correct = [], []
    with torch.no_grad():
        for inputs, targets in data:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            losses.append(accelerator.gather_for_metrics(loss))
            correct.append(accelerator.gather_for_metrics((logits.argmax(-1) == targets).float()))
    loss, acc = torch.cat(losses).double(), torch.cat(correct).double()
    return {"eval_loss": (loss.sum() / loss.numel()).item(), "eval_accuracy": (acc.sum() / acc.numel()).item()}


def test_early_stopping_mid_epoch_evaluates_the_model_it_stopped_with():
    """Accelerate's scripts ``break`` and still evaluate: so does a stop."""
    from hookloop import hookimpl

    class StopAt:
        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step == 5:
                loop.stop("enough")

    def eval_set():
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(20, 12, generator=g), torch.randint(0, 4, (20,), generator=g)),
                          batch_size=8)

    reset_accelerate()
    model, data = mlp_job()
    optimizer, scheduler = brief_optim(model, data)
    accelerator = Accelerator()
    hand = train_by_hand_updates(accelerator, model, optimizer, data, scheduler, 5)
    expected = eval_by_hand(accelerator, hand, accelerator.prepare(eval_set()))

    reset_accelerate()
    model, data = mlp_job()
    optimizer, scheduler = brief_optim(model, data)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                eval_data=eval_set(), plugins=[StopAt()])
    metrics = loop.fit(epochs=EPOCHS)
    assert loop.state.global_step == 5 and loop.state.epoch == 0  # mid-epoch
    assert metrics == expected  # the stopped model's metrics, bit for bit
    for name, value in hand.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_two_metric_plugins_both_reach_the_metrics_from_one_forward_per_batch():
    from hookloop import hookimpl

    forwards = []

    class CountForwards(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if not self.training:
                forwards.append(len(x))
            return self.inner(x)

    class MeanLogit:  # returns per-example values: the loop averages them
        @hookimpl
        def after_eval_step(self, loop, outputs):
            return {"mean_logit": loop.accelerator.gather_for_metrics(outputs.mean(dim=-1))}

    class MaxLogit:  # accumulates itself and writes in on_eval_end
        @hookimpl
        def on_eval_start(self):
            self.best = float("-inf")

        @hookimpl
        def after_eval_step(self, loop, outputs):
            self.best = max(self.best, loop.accelerator.gather_for_metrics(outputs).max().item())

        @hookimpl
        def on_eval_end(self, metrics):
            metrics["max_logit"] = self.best

    reset_accelerate()
    model, data = mlp_job()
    optimizer, _ = brief_optim(model, data)
    x = torch.randn(20, 12)
    evald = DataLoader(TensorDataset(x, torch.randint(0, 4, (20,))), batch_size=8)
    loop = Loop(model=CountForwards(model), optimizer=optimizer, train_data=data, eval_data=evald,
                plugins=[MeanLogit(), MaxLogit()])
    metrics = loop.evaluate()
    assert set(metrics) == {"eval_loss", "eval_accuracy", "mean_logit", "max_logit"}
    assert forwards == [8, 8, 4]  # one forward per batch, shared by three metric plugins
    model.eval()
    with torch.no_grad():
        logits = model(x)
    assert metrics["max_logit"] == logits.max().item()
    assert metrics["mean_logit"] == pytest.approx(logits.mean().item(), abs=1e-6)


def test_except_value_error_around_fit_catches_the_model_s_value_error():
    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(12, 4)

        def forward(self, x):
            raise ValueError("inputs out of range")

    reset_accelerate()
    model, data = Picky(), mlp_job()[1]
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), train_data=data)
    try:
        loop.fit(epochs=1)
    except ValueError as exc:  # no wrapper in between
        assert type(exc) is ValueError and str(exc) == "inputs out of range"
        assert exc.__notes__ == ["hookloop: raised in hook 'training_step' of plugin 'supervised' (built-in)"]
    else:
        pytest.fail("the model's ValueError did not reach the caller")
