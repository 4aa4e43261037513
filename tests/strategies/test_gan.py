"""The GAN strategy: two networks trained in turn by one loop.

Every test here runs in one process in well under a second or two, except
the slow-marked two-process run (two `accelerate launch`es, ~10 s each).
"""

import json
import math

import launching
import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.plugins import GradClip
from hookloop.strategies import GAN
from hookloop.testing import HookRecorder
from paths import ROOT, SCRIPTS  # noqa: F401

SCRIPTS = SCRIPTS
LATENT = 8


def ring(n, seed=0):
    """n points of a mixture of 8 Gaussians on a circle of radius 2."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 8, (n,), generator=g)
    centers = torch.stack([torch.cos(k * math.pi / 4), torch.sin(k * math.pi / 4)], 1) * 2
    return centers + 0.1 * torch.randn(n, 2, generator=g)


def mlp(i, o, hidden=64):
    return torch.nn.Sequential(
        torch.nn.Linear(i, hidden), torch.nn.LeakyReLU(0.2),
        torch.nn.Linear(hidden, hidden), torch.nn.LeakyReLU(0.2),
        torch.nn.Linear(hidden, o),
    )


def gan_loop(plugins=(), *, n=64, batch_size=16, seed=0, accelerator=None, schedulers=False,
             strategy=None, data=None, lr=1e-3, **loop_kwargs):
    """A seeded GAN loop on the 2-D ring: G: 8 -> 2, D: 2 -> 1."""
    set_seed(seed)
    G, D = mlp(LATENT, 2), mlp(2, 1)
    opt_g = torch.optim.Adam(G.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=lr, betas=(0.5, 0.999))
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.9) if schedulers else None
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.9) if schedulers else None
    if data is None:
        data = DataLoader(TensorDataset(ring(n)), batch_size=batch_size, shuffle=True)
    loop_kwargs.setdefault("block", ["progress"])
    return Loop(
        networks={"generator": Network(G, opt_g, sched_g), "discriminator": Network(D, opt_d, sched_d)},
        strategy=strategy if strategy is not None else GAN(latent_dim=LATENT),
        train_data=data, plugins=list(plugins), accelerator=accelerator, **loop_kwargs,
    )


def params(loop, name):
    return [p.detach().clone() for p in loop.networks[name].unwrapped.parameters()]


def grads(loop, name):
    return [None if p.grad is None else p.grad.detach().clone()
            for p in loop.networks[name].unwrapped.parameters()]


def same(a, b):
    """Parameter or gradient lists equal, a missing gradient counting as zero."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        x = torch.zeros_like(y) if x is None else x
        y = torch.zeros_like(x) if y is None else y
        if not torch.equal(x, y):
            return False
    return True


# -- construction --------------------------------------------------------------


@pytest.mark.parametrize(
    "names, message",
    [
        (["generator"], "missing 'discriminator'"),
        (["discriminator"], "missing 'generator'"),
        (["model"], "missing 'generator', 'discriminator'; unexpected 'model'"),
        (["generator", "discriminator", "encoder"], "unexpected 'encoder'"),
    ],
)
def test_check_networks_names_what_is_missing(names, message):
    def net():
        m = torch.nn.Linear(2, 2)
        return Network(m, torch.optim.SGD(m.parameters(), lr=0.1))

    with pytest.raises(ValueError, match=message):
        Loop(networks={n: net() for n in names}, strategy=GAN(latent_dim=2), train_data=[torch.zeros(2)])


@pytest.mark.parametrize("data, given, fix", [
    (ring(64).float(), "a tensor of shape (64, 2): the GAN strategy would iterate its rows one by one",
     "Pass DataLoader(TensorDataset(tensor), batch_size=..., shuffle=True)"),
    (TensorDataset(ring(64)), "a TensorDataset of 64 examples: the GAN strategy would iterate its examples",
     "Pass DataLoader(dataset, batch_size=..., shuffle=True)"),
])
def test_a_tensor_or_a_dataset_as_train_data_is_refused_at_loop_naming_dataloader(data, given, fix):
    """Iterated as they are, they give one sample per step (64 updates an epoch for a
    (64, 2) tensor, each without a batch dimension): refused before anything runs."""
    class Counter:
        def __init__(self):
            self.steps = 0

        @hookimpl
        def after_step(self):
            self.steps += 1

    counter = Counter()
    with pytest.raises(TypeError) as info:
        gan_loop([counter], data=data).fit(epochs=1)
    message = str(info.value)
    assert message.startswith(f"train_data is {given}") and fix in message, message
    assert "DataLoader" in message and counter.steps == 0


def test_a_tensor_put_in_place_of_the_train_data_after_loop_is_refused_by_fit():
    loop = gan_loop()
    loop.train_data = ring(64)
    with pytest.raises(TypeError, match="train_data is a tensor of shape \\(64, 2\\)"):
        loop.fit(epochs=1)
    assert loop.state.global_step == 0


def test_the_same_tensor_in_a_dataloader_trains_in_batches():
    recorder = HookRecorder(hooks=["after_step"])
    loop = gan_loop([recorder], data=DataLoader(TensorDataset(ring(64)), batch_size=16, shuffle=True))
    loop.fit(epochs=1)
    assert recorder.count("after_step") == 4 == loop.state.global_step
    assert all(c["outputs"]["discriminator"]["real_samples"].shape == (16, 2)
               for c in recorder.calls_of("after_step"))


@pytest.mark.parametrize(
    "kwargs, message",
    [({"latent_dim": 0}, "latent_dim"), ({"latent_dim": 4, "n_critic": 0}, "n_critic"),
     ({"latent_dim": (4, "x")}, "latent_dim")],
)
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GAN(**kwargs)


# -- the order of hooks ----------------------------------------------------------


def test_hook_order_per_batch_discriminator_then_generator():
    recorder = HookRecorder()
    loop = gan_loop([recorder], schedulers=True)
    loop.fit(max_steps=2)

    def label(call):
        network = call.kwargs.get("network")
        return call.hook if network is None else f"{call.hook}:{network.name}"

    per_network = ["compute_loss", "before_backward", "after_backward", "commit_update",
                   "before_optimizer_step", "after_optimizer_step", "before_scheduler_step",
                   "after_scheduler_step", "before_zero_grad", "after_zero_grad"]
    one_batch = [
        "before_step", "training_step",
        *(f"{h}:discriminator" for h in per_network),
        *(f"{h}:generator" for h in per_network),
        "after_step",
    ]
    names = [label(c) for c in recorder.calls]
    start, end = names.index("before_step"), names.index("on_fit_end")
    # max_steps ends the epoch early, and the epoch still ends
    # (a max_steps update has no safe point of its own: the epoch end is part of it)
    assert names[start:end] == [*one_batch, "on_safe_point", *one_batch, "on_train_epoch_end",
                                "on_epoch_end", "on_safe_point"]
    # what a logging plugin sees: both losses and both networks' outputs
    after = recorder.calls_of("after_step")[0]
    assert set(after["loss"]) == {"generator", "discriminator"}
    assert set(after["outputs"]["discriminator"]) == {"real", "fake", "real_samples", "fake_samples", "latent"}
    assert set(after["outputs"]["generator"]) == {"fake", "fake_samples", "real_samples", "latent"}


# -- each step touches only its own network ----------------------------------------


class Snapshots:
    """Parameters and gradients of both networks at every point of a batch."""

    name = "snapshots"

    def __init__(self):
        self.batches = []

    @hookimpl
    def before_step(self, loop):
        self.batches.append({"start": self._take(loop)})

    @hookimpl
    def before_backward(self, loop, network):
        self.batches[-1][f"before_backward:{network.name}"] = self._take(loop)

    @hookimpl
    def after_backward(self, loop, network):
        self.batches[-1][f"backward:{network.name}"] = self._take(loop)

    @hookimpl
    def after_optimizer_step(self, loop, network):
        self.batches[-1][f"step:{network.name}"] = self._take(loop)

    @staticmethod
    def _take(loop):
        return {n: {"params": params(loop, n), "grads": grads(loop, n)} for n in loop.networks}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_changes_only_its_own_network(accumulation):
    snaps = Snapshots()
    acc = Accelerator(gradient_accumulation_steps=accumulation)
    loop = gan_loop([snaps], accelerator=acc)
    loop.fit(max_steps=4 // accumulation)  # updates: 4 batches
    assert len(snaps.batches) == 4
    for i, b in enumerate(snaps.batches):
        # the discriminator's backward adds nothing to the generator's gradients
        assert same(b["backward:discriminator"]["generator"]["grads"],
                    b["before_backward:discriminator"]["generator"]["grads"])
        # the generator's backward adds nothing to the discriminator's gradients
        # (under accumulation they are still being accumulated there)
        assert same(b["backward:generator"]["discriminator"]["grads"],
                    b["before_backward:generator"]["discriminator"]["grads"])
        assert any(g is not None and g.abs().sum() > 0 for g in b["backward:generator"]["generator"]["grads"])
        if (i + 1) % accumulation:
            assert "step:discriminator" not in b and "step:generator" not in b
            continue
        d_step, g_step = b["step:discriminator"], b["step:generator"]
        # D's update: D changed, G did not
        assert not same(d_step["discriminator"]["params"], b["start"]["discriminator"]["params"])
        assert same(d_step["generator"]["params"], b["start"]["generator"]["params"])
        # G's update: G changed, D stayed as D's update left it
        assert not same(g_step["generator"]["params"], b["start"]["generator"]["params"])
        assert same(g_step["discriminator"]["params"], d_step["discriminator"]["params"])


# -- losses are plugins ------------------------------------------------------------------


class Hinge:
    """A hinge loss for the discriminator only (Lim & Ye 2017)."""

    name = "hinge"

    def __init__(self):
        self.returned = []

    @hookimpl
    def compute_loss(self, network, outputs):
        if network.name != "discriminator":
            return None  # the generator keeps the default
        loss = F.relu(1 - outputs["real"]).mean() + F.relu(1 + outputs["fake"]).mean()
        self.returned.append(loss)
        return loss


def _final(loop):
    return params(loop, "generator") + params(loop, "discriminator")


def test_same_seed_same_run_and_hinge_plugin_replaces_default_loss():
    baseline = gan_loop()
    baseline.fit(max_steps=6)
    again = gan_loop()
    again.fit(max_steps=6)
    assert same(_final(baseline), _final(again))  # the seed fixes the run, noise included

    hinge = Hinge()
    recorder = HookRecorder(hooks=["after_step"])
    loop = gan_loop([hinge, recorder])
    loop.fit(max_steps=6)
    assert not same(_final(loop), _final(baseline))
    steps = recorder.calls_of("after_step")
    assert len(hinge.returned) == 6
    for call, mine in zip(steps, hinge.returned):
        assert call["loss"]["discriminator"] is mine
        # the generator's loss is still the default non-saturating one
        fake = call["outputs"]["generator"]["fake"]
        expected = F.binary_cross_entropy_with_logits(fake, torch.ones_like(fake))
        assert torch.allclose(call["loss"]["generator"], expected)


def test_default_loss_is_a_plugin_named_loss():
    loop = gan_loop(block=["progress", "loss"])
    with pytest.raises(TypeError, match="compute_loss returned NoneType for network 'discriminator'"):
        loop.fit(max_steps=1)


class GradientPenalty:
    """WGAN-GP (Gulrajani et al. 2017) as a compute_loss plugin only: the
    arguments carry everything it needs."""

    name = "wgan-gp"

    def __init__(self):
        self.penalties = []

    @hookimpl
    def compute_loss(self, network, outputs):
        if network.name == "generator":
            return -outputs["fake"].mean()
        real, fake = outputs["real_samples"], outputs["fake_samples"]
        eps = torch.rand(real.shape[0], 1)
        mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (g,) = torch.autograd.grad(network.model(mix).sum(), mix, create_graph=True)
        penalty = ((g.norm(dim=1) - 1) ** 2).mean()
        self.penalties.append(penalty.detach())
        return outputs["fake"].mean() - outputs["real"].mean() + 10 * penalty


def test_a_gradient_penalty_plugin_has_what_it_needs():
    gp = GradientPenalty()
    loop = gan_loop([gp])
    before = params(loop, "discriminator")
    loop.fit(max_steps=3)
    assert len(gp.penalties) == 3 and all(torch.isfinite(p) for p in gp.penalties)
    assert not same(params(loop, "discriminator"), before)


# -- it learns --------------------------------------------------------------------------


def test_toy_mixture_statistics_move_toward_the_data():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    try:
        data = DataLoader(TensorDataset(ring(1024)), batch_size=64, shuffle=True)
        loop = gan_loop(data=data)
        G = loop.networks["generator"].unwrapped
        z = torch.randn(2000, LATENT, generator=torch.Generator().manual_seed(1))

        def stats(x):  # mean distance from the origin, mean per-axis spread
            return x.norm(dim=1).mean().item(), x.std(0).mean().item()

        target = stats(ring(2000, seed=1))
        with torch.no_grad():
            before = stats(G(z))
        loop.fit(max_steps=300)
        with torch.no_grad():
            after = stats(G(z))
    finally:
        torch.set_num_threads(threads)
    # seen: radius 0.15 -> 1.85 (data 2.0), spread 0.07 -> 1.40 (data 1.42)
    for b, a, t in zip(before, after, target):
        assert abs(a - t) < 0.4 * abs(b - t), (before, after, target)


# -- step counting ------------------------------------------------------------------------


class StepLog:
    """Which batch (1-based) each per-network hook fired on."""

    name = "steplog"

    def __init__(self):
        self.log = {}

    def _add(self, hook, loop, network):
        self.log.setdefault(f"{hook}:{network.name}", []).append(loop.state.micro_step + 1)

    @hookimpl
    def after_backward(self, loop, network):
        self._add("backward", loop, network)

    @hookimpl
    def after_optimizer_step(self, loop, network):
        self._add("step", loop, network)


@pytest.mark.parametrize("n_batches, steps_on", [(4, [2, 4]), (5, [2, 4, 5])])
def test_gradient_accumulation_counts_each_batch_once(n_batches, steps_on):
    steps = StepLog()
    acc = Accelerator(gradient_accumulation_steps=2)
    loop = gan_loop([steps], n=16 * n_batches, accelerator=acc)
    loop.fit(epochs=1)
    every_batch = list(range(1, n_batches + 1))
    assert steps.log == {
        "backward:discriminator": every_batch, "backward:generator": every_batch,
        # the partial group at the end of the data steps too
        "step:discriminator": steps_on, "step:generator": steps_on,
    }


def test_n_critic_trains_the_generator_every_nth_batch():
    steps = StepLog()
    recorder = HookRecorder(hooks=["after_step"])
    loop = gan_loop([steps, recorder], n=16 * 6, strategy=GAN(latent_dim=LATENT, n_critic=3))
    loop.fit(epochs=1)
    assert steps.log["step:discriminator"] == [1, 2, 3, 4, 5, 6]
    assert steps.log["step:generator"] == [3, 6]
    assert [sorted(c["loss"]) for c in recorder.calls_of("after_step")] == (
        [["discriminator"], ["discriminator"], ["discriminator", "generator"]] * 2
    )


def test_n_critic_with_accumulation_counts_discriminator_updates():
    steps = StepLog()
    acc = Accelerator(gradient_accumulation_steps=2)
    loop = gan_loop([steps], n=16 * 8, accelerator=acc, strategy=GAN(latent_dim=LATENT, n_critic=2))
    loop.fit(epochs=1)
    assert steps.log["step:discriminator"] == [2, 4, 6, 8]
    # the generator trains on both batches of every second accumulation group
    assert steps.log["backward:generator"] == [3, 4, 7, 8]
    assert steps.log["step:generator"] == [4, 8]


# -- per-network plugins -------------------------------------------------------------------


class NormProbe:
    name = "probe"

    def __init__(self):
        self.norms = {}

    @hookimpl
    def before_optimizer_step(self, network):
        grads = [p.grad for p in network.model.parameters() if p.grad is not None]
        self.norms.setdefault(network.name, []).append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())


def test_gradclip_clips_each_network():
    probe = NormProbe()
    loop = gan_loop([GradClip(max_norm=1e-3), probe])
    loop.fit(max_steps=3)
    assert set(probe.norms) == {"generator", "discriminator"}
    for name, norms in probe.norms.items():
        assert len(norms) == 3
        assert all(n <= 1e-3 * 1.001 for n in norms), (name, norms)
        # the norm measured before clipping was larger: clipping did something
        assert float(loop.networks[name].grad_norm) > 1e-3


# -- mixed precision -------------------------------------------------------------------------


def test_fp16_is_refused_with_a_clear_error():
    loop = gan_loop(accelerator=Accelerator(mixed_precision="fp16", cpu=True))
    before = _final(loop)
    with pytest.raises(ValueError, match="does not support mixed_precision='fp16'.*bf16"):
        loop.fit(max_steps=1)
    assert same(_final(loop), before)


def test_bf16_trains():
    loop = gan_loop(accelerator=Accelerator(mixed_precision="bf16", cpu=True))
    before = _final(loop)
    loop.fit(max_steps=3)
    after = _final(loop)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in after)
    assert not same(after, before)


# -- batches and noise --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, real, expected",
    [
        ("tensor", None, "a"),
        ("pair", None, "a"),
        ({"pixel_values": "a", "images": "b"}, None, "a"),
        ({"labels": "b", "images": "a"}, None, "a"),
        ({"labels": [1, 2], "x": "a", "y": "b"}, None, "a"),
        ({"x": "b", "y": "a"}, "y", "a"),
        ("pair", lambda b: b[1], "b"),
    ],
)
def test_real_sample_of_a_batch(batch, real, expected):
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    tensors = {"a": a, "b": b}
    if batch == "tensor":
        batch = a
    elif batch == "pair":
        batch = (a, b)
    else:
        batch = {k: tensors.get(v, v) if isinstance(v, str) else v for k, v in batch.items()}
    assert GAN(latent_dim=2, real=real).real_samples(batch) is tensors[expected]


@pytest.mark.parametrize("batch", ["text", {"labels": [1, 2]}, ([1, 2],)])
def test_unusable_batch_says_how_to_fix_it(batch):
    with pytest.raises(TypeError, match="GAN\\(real=|not a tensor"):
        GAN(latent_dim=2).real_samples(batch)


def test_mapping_batches_train_on_their_images():
    class DictData(torch.utils.data.Dataset):
        def __init__(self):
            self.x = ring(32)

        def __len__(self):
            return 32

        def __getitem__(self, i):
            return {"images": self.x[i], "labels": i % 8}

    recorder = HookRecorder(hooks=["compute_loss"])
    loop = gan_loop([recorder], data=DataLoader(DictData(), batch_size=16))
    loop.fit(epochs=1)
    calls = recorder.calls_of("compute_loss")
    assert len(calls) == 4
    for call in calls:
        assert call["outputs"]["real_samples"] is call["batch"]["images"]


def test_latent_sampler_is_used_and_noise_changes_every_step():
    seen = []

    def sampler(n, generator):
        z = torch.rand(n, LATENT, generator=generator, device=generator.device) * 2 - 1
        seen.append(z)
        return z

    recorder = HookRecorder(hooks=["after_step"])
    loop = gan_loop([recorder], strategy=GAN(latent_dim=LATENT, latent_sampler=sampler))
    loop.fit(max_steps=3)
    latents = [c["outputs"]["discriminator"]["latent"] for c in recorder.calls_of("after_step")]
    assert len(seen) == 3 and all(a is b for a, b in zip(latents, seen))
    assert not torch.equal(seen[0], seen[1])
    assert loop.strategy.state_dict() == {"seed": 0, "d_updates": 3}  # set_seed(0) seeds the noise


# -- two processes ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("options, steps", [((), {"generator": 16, "discriminator": 16}),
                                            (("--accum", "2", "--n-critic", "2"),
                                             {"generator": 4, "discriminator": 8})])
def test_two_processes_stay_identical(tmp_path, options, steps):
    out = tmp_path / "report.json"
    proc = launching.run_two("gan_two_processes.py", out, *options, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["num_processes"] == 2
    assert report["generator_identical"] and report["discriminator_identical"], report
    assert report["latents_differ"], report  # each rank drew its own noise
    assert report["steps"] == steps
