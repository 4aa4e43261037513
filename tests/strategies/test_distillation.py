"""The distillation strategy: a frozen teacher stays bitwise unchanged, the
student trains bit for bit like a hand-written Accelerate distillation loop,
the loss is a replaceable plugin, two processes agree."""

import json

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.strategies import Distillation, DistillationLoss, distillation_loss
from hookloop.testing import parameters, reset_accelerate
from paths import ROOT, SCRIPTS  # noqa: F401

SCRIPTS = SCRIPTS


def mlp(hidden, dropout=0.1):
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(hidden, 3))


def parts(seed=0, n=64, batch_size=8, epochs=2):
    """Seeded teacher (with dropout: only eval mode keeps it deterministic),
    student, Adam, a warm-up schedule and shuffled data."""
    set_seed(seed)
    x = torch.randn(n, 8)
    y = torch.randint(0, 3, (n,))
    teacher, student = mlp(32), mlp(8)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    total = epochs * len(train)
    scheduler = LambdaLR(optimizer, lambda s: min((s + 1) / 2, (total - s) / total))
    held_out = DataLoader(TensorDataset(x[:24], y[:24]), batch_size=batch_size)
    return teacher, student, optimizer, scheduler, train, held_out


def distill_loop(*, plugins=(), accumulation=1, eval_data=False, temperature=2.0, alpha=0.5, **kw):
    teacher, student, optimizer, scheduler, train, held_out = parts(**kw)
    return Loop(
        networks={"teacher": Network(teacher, None), "student": Network(student, optimizer, scheduler)},
        strategy=Distillation(temperature=temperature, alpha=alpha),
        train_data=train, eval_data=held_out if eval_data else None, plugins=list(plugins),
        accelerator=Accelerator(gradient_accumulation_steps=accumulation), block=["progress"],
    )


def by_hand(*, epochs=2, accumulation=1, T=2.0, alpha=0.5, **kw):
    """The hand-written Accelerate distillation loop (Hinton's soft targets)."""
    teacher, student, optimizer, scheduler, train, _ = parts(epochs=epochs, **kw)
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    teacher = accelerator.prepare_model(teacher, evaluation_mode=True)
    teacher.eval()
    teacher.requires_grad_(False)
    student, optimizer, train, scheduler = accelerator.prepare(student, optimizer, train, scheduler)
    for _ in range(epochs):
        student.train()
        for x, y in train:
            with accelerator.accumulate(student):
                with torch.no_grad():
                    t = teacher(x)
                s = student(x)
                soft = F.kl_div(F.log_softmax(s / T, dim=-1), F.softmax(t / T, dim=-1),
                                reduction="batchmean") * T * T
                loss = alpha * soft + (1 - alpha) * F.cross_entropy(s, y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return [p.detach().clone() for p in accelerator.unwrap_model(student).parameters()]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_student_trains_bit_for_bit_like_the_hand_written_loop(accumulation):
    expected = by_hand(accumulation=accumulation)
    reset_accelerate()
    loop = distill_loop(accumulation=accumulation)
    loop.fit(epochs=2)
    got = parameters(loop, "student")
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    untrained = [p.detach() for p in parts()[1].parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(got, untrained))  # it did train


def test_the_teacher_is_frozen_bitwise_in_eval_mode_and_without_gradients():
    teacher_before = [p.detach().clone() for p in parts()[0].parameters()]
    modes = []

    class Watch:
        @hookimpl
        def after_step(self, loop, outputs):
            modes.append(loop.networks["teacher"].model.training)
            assert not outputs["teacher"].requires_grad and outputs["student"].requires_grad

    loop = distill_loop(plugins=[Watch()], eval_data=True)
    loop.fit(epochs=2)
    teacher = loop.networks["teacher"]
    assert modes and not any(modes)  # never in train mode, dropout never on
    assert not teacher.model.training
    assert all(not p.requires_grad and p.grad is None for p in teacher.unwrapped.parameters())
    after = parameters(loop, "teacher")
    assert all(torch.equal(a, b) for a, b in zip(after, teacher_before))
    assert teacher.optimizer is None


def test_evaluation_reports_the_student():
    loop = distill_loop(eval_data=True)
    metrics = loop.fit(epochs=1)
    student = loop.networks["student"].unwrapped.eval()
    x, y = parts()[5].dataset.tensors
    with torch.no_grad():
        logits = student(x)
    assert set(metrics) >= {"eval_loss", "eval_accuracy"}
    assert metrics["eval_accuracy"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    assert metrics["eval_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)


def test_the_loss_is_a_plugin_a_user_plugin_replaces():
    seen = []

    class SoftOnly:
        @hookimpl
        def compute_loss(self, loop, network, outputs):
            seen.append(network.name)
            return distillation_loss(outputs["student"], outputs["teacher"], None,
                                     loop.strategy.temperature)

    default = distill_loop(alpha=1.0)
    default.fit(epochs=1)
    reset_accelerate()
    replaced = distill_loop(plugins=[SoftOnly()], alpha=0.0)  # alpha ignored by the plugin
    replaced.fit(epochs=1)
    assert seen == ["student"] * 8
    assert isinstance(default.plugins.get("loss"), DistillationLoss)
    assert all(torch.equal(a, b) for a, b in zip(parameters(default, "student"),
                                                 parameters(replaced, "student")))


def test_the_loss_formula():
    torch.manual_seed(0)
    s, t, y = torch.randn(5, 4), torch.randn(5, 4), torch.randint(0, 4, (5,))
    T = 3.0
    p_t = F.softmax(t / T, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(s / T, -1))).sum(-1).mean()
    assert distillation_loss(s, t, y, T, 1.0).item() == pytest.approx(T * T * kl.item(), rel=1e-5)
    assert distillation_loss(s, t, y, T, 0.0).item() == pytest.approx(F.cross_entropy(s, y).item())
    assert distillation_loss(s, t, None, T, 0.3).item() == pytest.approx(T * T * kl.item(), rel=1e-5)
    assert distillation_loss(s, s, None, T).item() == pytest.approx(0, abs=1e-6)
    # one row per position: (batch, length, classes) logits
    seq = distillation_loss(s.reshape(1, 5, 4), t.reshape(1, 5, 4), y.reshape(1, 5), T, 0.5)
    assert seq.item() == pytest.approx(distillation_loss(s, t, y, T, 0.5).item())


@pytest.mark.parametrize("networks,message", [
    ({"teacher": "none"}, "uses the networks 'teacher', 'student'"),
    ({"teacher": "opt", "student": "opt"}, r"never trains the teacher.*Network\(teacher, None\)"),
])
def test_networks_that_do_not_fit_are_refused_at_construction(networks, message):
    teacher, student, optimizer, *_ = parts()
    models = {"teacher": teacher, "student": student}
    given = {name: Network(models[name], torch.optim.SGD(models[name].parameters(), lr=0.1)
                           if kind == "opt" else None) for name, kind in networks.items()}
    with pytest.raises(ValueError, match=message):
        Loop(networks=given, strategy=Distillation(), train_data=parts()[4])


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": 0}, "temperature must be a positive number"),
    ({"temperature": "2"}, "temperature must be a positive number"),
    ({"alpha": 1.5}, r"alpha must be a number in \[0, 1\]"),
    ({"alpha": True}, r"alpha must be a number in \[0, 1\]"),
])
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Distillation(**kwargs)


def test_the_strategy_is_made_of_the_public_kit_only():
    """Distillation imports nothing private: what it uses is in hookloop.strategy."""
    import hookloop.strategy as kit
    from hookloop.strategies import distillation

    for name in ("Strategy", "StepOutput", "forward", "loss_and_backward", "update",
                 "logits_of", "targets_of"):
        assert getattr(distillation, name) is getattr(kit, name), name
    assert isinstance(Distillation(), kit.Strategy)
    assert Distillation.frozen_networks == ("teacher",)


@pytest.mark.slow
def test_two_processes_keep_the_student_in_step_and_the_teacher_frozen(tmp_path):
    from test_distributed import launch_two

    launch_two("distill_two_processes.py", tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_processes"] == 2
    assert report["student_identical_across_ranks"] and report["student_trained"]
    assert report["teacher_unchanged"] == [True, True]
    assert report["teacher_wrapped"] == [False, False] and report["student_wrapped"] == [True, True]
    assert report["optimizer_steps"] == [8, 8]  # 64 examples, batch 8, two ranks, 2 epochs
    assert report["eval_examples"] == [24, 24]  # each held-out example once over both ranks, per epoch
    assert 0 <= report["eval_accuracy"] <= 1
