"""The learning-rate finder, ``loop.find_lr()`` (Lightning's ``Tuner.lr_find``):
its suggestion lies in the steepest descent of its curve, it draws the curve,
it stops when the loss diverges, it runs the training step's hooks and no
others, and a fit after it is bitwise the fit without it."""

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop.plugins import GradClip
from hookloop.testing import parameters


def learnable_loop(seed=0, optimizer="adam", **loop_kwargs):
    """A loop whose loss can fall: 3 classes that a linear map of the inputs
    decides, an MLP with dropout, shuffled batches, a scheduler."""
    set_seed(seed)
    x = torch.randn(256, 8)
    y = (x @ torch.randn(8, 3)).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 3))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1e-3))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    loop_kwargs.setdefault("block", ["progress"])
    return Loop(model=model, optimizer=opt, scheduler=sched,
                train_data=DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True), **loop_kwargs)


def steepest_descent_range(lrs, losses, window=5, settling=10):
    """The learning rates where the smoothed loss falls fastest, from the
    curve alone: its fall per decade of learning rate over every window of
    ``window`` consecutive points (0.4 of a decade in a 100-point sweep over
    8 decades), past the first ``settling`` points (the running average
    still settling); the windows that fall at least half as fast as the
    fastest one; from the first such window's start to the last one's end."""
    x = [math.log10(lr) for lr in lrs]
    slopes = {j: (losses[j + window] - losses[j]) / (x[j + window] - x[j])
              for j in range(settling, len(losses) - window)
              if math.isfinite(losses[j]) and math.isfinite(losses[j + window])}
    fastest = min(slopes.values())
    assert fastest < 0, "the loss never falls: no descent to find"
    steep = [j for j, slope in slopes.items() if slope <= fastest / 2]
    return lrs[min(steep)], lrs[max(steep) + window]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_suggestion_lies_in_the_steepest_descent_of_the_curve(seed):
    result = learnable_loop(seed).find_lr()
    lrs, losses = result.lrs, result.losses
    assert len(lrs) == len(losses) == len(result.raw_losses) == 100 and result.stopped is None
    assert lrs[0] == 1e-8 and lrs[-1] == 1.0  # Lightning's defaults, evenly spaced in log10
    steps = [math.log10(b / a) for a, b in zip(lrs, lrs[1:])]
    assert max(steps) - min(steps) < 1e-9
    low, high = steepest_descent_range(lrs, losses)
    assert high / low < 50, (low, high)  # a range that says something: under 2 of the 8 decades
    assert low <= result.suggestion <= high, (result.suggestion, low, high)
    assert result.suggestion == lrs[result.suggestion_index] and result.reason is None


def test_the_plot_is_a_png_of_the_curve_with_the_suggestion_marked(tmp_path):
    from PIL import Image

    result = learnable_loop().find_lr()
    path = result.plot(tmp_path / "lr" / "find.png")
    assert path == tmp_path / "lr" / "find.png"
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 0 and image.height > 0
        pixels = np.asarray(image.convert("RGB"))
    assert (pixels == (31, 119, 180)).all(axis=-1).sum() > 200  # the curve
    assert (pixels == (214, 39, 40)).all(axis=-1).sum() > 50  # the suggestion's mark


def test_a_curve_too_short_gives_no_suggestion_but_says_why_and_still_plots(tmp_path):
    result = learnable_loop().find_lr(num_training=8)
    assert len(result.lrs) == 8 and result.suggestion is None and result.suggestion_index is None
    assert "raise num_training" in result.reason
    assert result.suggest(skip_begin=0, skip_end=0) is not None  # Lightning's suggestion(skip_begin, skip_end)
    assert result.plot(tmp_path / "short.png").stat().st_size > 0


def test_a_diverging_loss_stops_the_sweep_and_the_run_is_put_back():
    loop = learnable_loop(optimizer="sgd")
    before = parameters(loop)
    result = loop.find_lr(min_lr=1e-4, max_lr=1e4, num_training=100)
    losses = result.losses
    assert len(losses) < 100 and "exceeded 4 times the best" in result.stopped, result.stopped
    # Lightning's early_stop_threshold=4.0: at the first smoothed loss above 4 times the best before it
    assert losses[-1] > 4 * min(losses[:-1])
    assert all(losses[i] <= 4 * min(losses[:i]) for i in range(1, len(losses) - 1))
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(loop)))
    never = loop.find_lr(min_lr=1e-4, max_lr=1e4, num_training=100, early_stop_threshold=None)
    assert len(never.losses) > len(losses) and never.lrs[:len(losses)] == result.lrs
    assert never.stopped.startswith("the loss was inf")  # only a non-finite loss stops it now


class NoisyLoss:
    """A loss scaled by draws from numpy's and Python's global random states
    and by a count of its own updates (kept in its state_dict): a fit that
    starts from other random states, or another count, trains differently."""

    def __init__(self):
        self.updates = 0

    @hookimpl
    def compute_loss(self, outputs, batch):
        scale = 1 + 0.1 * np.random.rand() + 0.1 * random.random() + 0.01 * self.updates
        return F.cross_entropy(outputs, batch[1]) * scale

    @hookimpl
    def after_optimizer_step(self):
        self.updates += 1

    def state_dict(self):
        return {"updates": self.updates}

    def load_state_dict(self, state):
        self.updates = state["updates"]


def _supervised(accumulation, plugins):
    from hookloop.testing import tiny_loop

    return tiny_loop(plugins, accelerator=Accelerator(gradient_accumulation_steps=accumulation))


def _stateful(accumulation, plugins):
    """A stateful loader (torchdata's StatefulDataLoader under Accelerate's),
    which keeps its state and its first iterator across passes."""
    from accelerate import DataLoaderConfiguration
    from hookloop.testing import tiny_loop

    return tiny_loop(plugins, accelerator=Accelerator(
        gradient_accumulation_steps=accumulation,
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)))


def _own_generators(accumulation, plugins):
    """Batch norm (running statistics), a loader whose sampler shuffles
    with a generator of its own."""
    set_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    return Loop(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(opt, 5, 0.5),
                train_data=data, plugins=plugins, accelerator=accelerator, block=["progress"])


def _gan(accumulation, plugins):
    """The tiny GAN (n_critic=2), each network with a scheduler of its own."""
    from hookloop import Network
    from hookloop.strategies import GAN

    set_seed(0)
    data = torch.randn(4, 2)[torch.randint(0, 4, (64,))] + 0.1 * torch.randn(64, 2)
    networks = {}
    for name, sizes in (("generator", (4, 2)), ("discriminator", (2, 1))):
        model = torch.nn.Sequential(torch.nn.Linear(sizes[0], 16), torch.nn.LeakyReLU(0.2),
                                    torch.nn.Linear(16, sizes[1]))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.5, 0.999))
        networks[name] = Network(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97 ** s))
    return Loop(networks=networks, strategy=GAN(latent_dim=4, n_critic=2), plugins=plugins,
                train_data=DataLoader(TensorDataset(data), batch_size=16, shuffle=True),
                accelerator=Accelerator(gradient_accumulation_steps=accumulation), block=["progress"])


RUNS = {
    # name: (make(accumulation, plugins), accumulation, updates before find_lr, find_lr's arguments)
    "before the first fit": (_supervised, 1, 0, {}),
    "mid-epoch, accumulating": (_supervised, 2, 3, {"num_training": 30}),
    "own generators, batch norm": (_own_generators, 1, 12, {"num_training": 30}),
    "stateful loader, before the first fit": (_stateful, 1, 0, {"num_training": 30}),
    "stateful loader, mid-epoch": (_stateful, 1, 3, {"num_training": 30}),
    "gan, between epochs": (_gan, 1, 4, {"num_training": 30, "monitor": "generator"}),
    "gan, one network swept": (_gan, 2, 1, {"num_training": 20, "networks": ["discriminator"]}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_a_fit_after_find_lr_is_bitwise_the_fit_without_it(run):
    """Shuffled data, dropout, Adam, a warm-up scheduler (the supervised
    runs), gradient clipping and a loss drawing from numpy's and Python's
    random states, with a state of its own; find_lr before the first fit or
    in the middle of the run."""
    make, accumulation, first, kwargs = RUNS[run]
    runs = []
    for sweep in (False, True):
        loop = make(accumulation, [NoisyLoss(), GradClip(max_norm=1.0)] if make is not _gan else
                    [GradClip(max_norm=1.0)])
        if first:
            loop.fit(max_steps=first)
        if sweep:
            state = (loop.state.state_dict(), torch.get_rng_state(), np.random.get_state()[1].copy(),
                     random.getstate(), [n.optimizer.state_dict()["param_groups"][0]["lr"]
                                         for n in loop.networks.values()],
                     loop.accelerator.step, getattr(loop.train_data, "iteration", None))
            result = loop.find_lr(**kwargs)
            assert len(result.lrs) > 10  # it did train
            assert loop.state.state_dict() == state[0] and loop.state.stage is None
            assert torch.equal(torch.get_rng_state(), state[1]) and np.array_equal(np.random.get_state()[1], state[2])
            assert random.getstate() == state[3]
            assert [n.optimizer.state_dict()["param_groups"][0]["lr"] for n in loop.networks.values()] == state[4]
            # Accelerate's accumulation counter and epoch counter (a fit sets both again)
            assert (loop.accelerator.step, getattr(loop.train_data, "iteration", None)) == state[5:]
        loop.fit(epochs=2)
        runs.append({name: ({k: v.clone() for k, v in n.unwrapped.state_dict().items()},  # buffers too
                            n.optimizer.state_dict(), n.scheduler.state_dict() if n.scheduler is not None else None)
                     for name, n in loop.networks.items()})
        runs[-1]["position"] = loop.state.state_dict()
        runs[-1]["rng"] = torch.get_rng_state()
        loop.close()
    without, with_sweep = runs
    assert with_sweep["position"] == without["position"]
    assert torch.equal(with_sweep["rng"], without["rng"])
    for name in (n for n in without if n not in ("position", "rng")):
        params, optimizer, scheduler = with_sweep[name]
        assert params.keys() == without[name][0].keys()
        assert all(torch.equal(params[k], without[name][0][k]) for k in params), name
        assert all(torch.equal(a, b) for key, s in optimizer["state"].items()
                   for a, b in zip(s.values(), without[name][1]["state"][key].values())), name
        assert optimizer["param_groups"] == without[name][1]["param_groups"]
        assert scheduler == without[name][2]


def test_find_lr_runs_the_training_steps_hooks_not_the_epoch_or_checkpoint_hooks_nor_observers():
    seen, watched = [], []

    class Everything:
        pass

    def recorder(hook):
        def record(self, loop):
            seen.append((hook, loop.state.stage))
        return hookimpl(record)

    for hook in ("on_fit_start", "on_epoch_start", "before_step", "compute_loss", "before_backward",
                 "after_backward", "commit_update", "before_optimizer_step", "after_optimizer_step",
                 "before_scheduler_step", "after_scheduler_step", "before_zero_grad", "after_zero_grad",
                 "after_step", "on_train_epoch_end", "on_eval_start", "on_epoch_end", "on_safe_point",
                 "on_fit_end", "on_exception"):
        setattr(Everything, hook, recorder(hook))

    class Observer:
        changes_training = False  # like a progress bar or a learning-rate monitor

        @hookimpl
        def after_backward(self):
            watched.append("after_backward")

        @hookimpl
        def before_optimizer_step(self):
            watched.append("before_optimizer_step")

    loop = learnable_loop(plugins=[Everything(), Observer()])
    loop.find_lr(num_training=20)
    hooks = {hook for hook, _ in seen}
    assert hooks == {"before_step", "compute_loss", "before_backward", "after_backward", "commit_update",
                     "before_optimizer_step", "after_optimizer_step", "before_zero_grad", "after_zero_grad"}
    assert {stage for _, stage in seen} == {"find_lr"}
    assert [h for h, _ in seen].count("before_optimizer_step") == 20  # one per update
    assert watched == []  # an observer sees nothing of the sweep
    seen.clear()
    loop.fit(max_steps=1)  # and everything of training
    assert {"on_fit_start", "after_step", "before_scheduler_step", "on_safe_point"} <= {h for h, _ in seen}
    assert watched == ["after_backward", "before_optimizer_step"]


def test_a_plugins_error_in_the_sweep_names_it_and_leaves_the_run_as_it_was():
    class Breaks:
        calls = 0

        @hookimpl
        def after_backward(self):
            Breaks.calls += 1
            if Breaks.calls == 7:
                raise RuntimeError("broken on the 7th")

    loop = learnable_loop(plugins=[Breaks()])
    before, rng = parameters(loop), torch.get_rng_state()
    with pytest.raises(RuntimeError, match="broken on the 7th") as info:
        loop.find_lr()
    assert "hookloop: raised in hook 'after_backward' of plugin 'Breaks' during find_lr" in info.value.__notes__
    assert all(torch.equal(a, b) for a, b in zip(before, parameters(loop)))
    assert torch.equal(torch.get_rng_state(), rng) and loop.state.global_step == 0
    assert loop.state.stage is None and loop.networks["model"].scheduler is not None


def test_a_gan_sweeping_both_networks_must_say_which_loss_the_curve_follows(tiny_gan_loop):
    loop = tiny_gan_loop()
    with pytest.raises(ValueError, match=r"find_lr\(monitor='discriminator'\)"):
        loop.find_lr(num_training=12)
    result = loop.find_lr(num_training=12, monitor="generator")
    assert len(result.lrs) == 12 and loop.state.global_step == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"min_lr": 1e-2, "max_lr": 1e-3}, r"min_lr \(0.01\) must be smaller than max_lr \(0.001\)"),
    ({"min_lr": 0.0}, "min_lr must be positive with mode='exponential'"),
    ({"num_training": 1}, "num_training must be an int of at least 2"),
    ({"mode": "cosine"}, "mode must be 'exponential' or 'linear', got 'cosine'"),
    ({"early_stop_threshold": 0.5}, "early_stop_threshold must be a number above 1"),
    ({"networks": ["encoder"]}, r"find_lr\(networks=...\): no network 'encoder'; the loop's networks are \['model'\]"),
    ({"monitor": "encoder"}, r"find_lr\(monitor='encoder'\): no such network"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message, tiny_loop):
    loop = tiny_loop()
    with pytest.raises(ValueError, match=message):
        loop.find_lr(**kwargs)
    assert loop.state.global_step == 0


def test_find_lr_is_refused_from_inside_a_fit_and_on_an_iterator(tiny_loop):
    class Tune:
        @hookimpl
        def on_epoch_start(self, loop):
            loop.find_lr()

    with pytest.raises(RuntimeError, match="find_lr cannot run inside 'train'"):
        tiny_loop([Tune()]).fit(epochs=1)
    loop = tiny_loop(prepare=False)
    loop.train_data = iter(list(loop.train_data))
    with pytest.raises(TypeError, match="train_data is an iterator"):
        loop.find_lr()


@pytest.mark.slow
def test_two_processes_see_one_curve_stop_together_and_fit_as_without_it(tmp_path):
    from launching import two_ranks

    code, output = two_ranks("lr_finder_two_processes.py", tmp_path, timeout=120)
    assert code == 0, output[-3000:]  # None: a rank stopped alone and the other hung
    ranks = [json.loads((tmp_path / f"lr-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["losses"] == ranks[1]["losses"]
    assert "diverged" in ranks[0]["stopped"] and len(ranks[0]["lrs"]) < 80
    assert ranks[0]["suggestion"] is not None and all(r["same_fit"] for r in ranks)
    p0, p1 = (torch.load(tmp_path / f"params-{r}.pt") for r in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
