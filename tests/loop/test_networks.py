"""How a Loop's networks are given: one optimizer (or scheduler) belongs to one
``Network`` (given to two it would be stepped twice per update, so ``Loop(...)``
refuses it, naming both), several modules that share one optimizer are one
``Network`` whose model holds them (docs/plugins.md, "Several modules, one
optimizer"), and a class given where an instance belongs is refused naming it.

All in one process in about a second, except the slow-marked two-process run
(one ``accelerate launch``, ~15 s)."""

import json
import re

import launching
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.strategies import GAN
from hookloop.strategy import Strategy
from hookloop.testing import HookRecorder, parameters
from paths import ROOT

GUIDE = ROOT / "docs" / "plugins.md"


class Started:
    """Records whether Loop(...) got as far as its plugins (on_loop_start)."""

    def __init__(self):
        self.started = False

    @hookimpl
    def on_loop_start(self):
        self.started = True


def ring(n=64):
    return DataLoader(TensorDataset(torch.randn(n, 2)), batch_size=16, shuffle=True)


class FourWay(Strategy):
    """CycleGAN's four networks, by name only (never trained here)."""

    name = "four-way"
    network_names = ("g_ab", "g_ba", "d_a", "d_b")


# -- one optimizer, two networks: refused ------------------------------------------------------


def test_one_optimizer_given_to_two_networks_is_refused_naming_both_and_the_fix():
    G_AB, G_BA, D_A, D_B = (torch.nn.Linear(2, 2) for _ in range(4))
    opt_g = torch.optim.Adam([*G_AB.parameters(), *G_BA.parameters()])
    opt_d = torch.optim.Adam([*D_A.parameters(), *D_B.parameters()])
    started = Started()
    with pytest.raises(ValueError) as info:
        Loop(networks={"g_ab": Network(G_AB, opt_g), "g_ba": Network(G_BA, opt_g),
                       "d_a": Network(D_A, opt_d), "d_b": Network(D_B, opt_d)},
             strategy=FourWay(), train_data=ring(), plugins=[started])
    message = str(info.value)
    assert "networks 'g_ab' and 'g_ba' are given the same optimizer (Adam)" in message
    assert "step twice" in message and "its own optimizer" in message
    assert "one Network: Network(Parts({'g_ab': ..., 'g_ba': ...}), optimizer)" in message
    assert "network.model(part, x)" in message and "Several modules, one optimizer" in message
    assert not started.started  # refused before the plugins, before anything is prepared


def test_the_gan_given_one_optimizer_for_both_networks_is_refused():
    G, D = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    shared = torch.optim.SGD([*G.parameters(), *D.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="networks 'generator' and 'discriminator' are given the same optimizer"):
        Loop(networks={"generator": Network(G, shared), "discriminator": Network(D, shared)},
             strategy=GAN(latent_dim=4), train_data=ring())


def test_one_scheduler_given_to_two_networks_is_refused():
    G, D = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.SGD(D.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt_g, 1)
    with pytest.raises(ValueError, match="networks 'generator' and 'discriminator' are given the same "
                                         "scheduler \\(StepLR\\)"):
        Loop(networks={"generator": Network(G, opt_g, scheduler), "discriminator": Network(D, opt_d, scheduler)},
             strategy=GAN(latent_dim=4), train_data=ring())


def test_networks_with_optimizers_of_their_own_are_accepted():
    G, D = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    loop = Loop(networks={"generator": Network(G, torch.optim.SGD(G.parameters(), lr=0.1)),
                          "discriminator": Network(D, torch.optim.SGD(D.parameters(), lr=0.1))},
                strategy=GAN(latent_dim=4), train_data=ring(), block=["progress"])
    loop.fit(max_steps=1)


# -- several modules, one optimizer: one Network (the guide's example) ----------------------------


def _guide_example():
    body = GUIDE.read_text().split("\n## Several modules, one optimizer\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_guide_s_several_modules_example_trains_both_parts_with_one_optimizer_step_per_update():
    blocks = _guide_example()
    assert "class Parts(torch.nn.ModuleDict)" in blocks[0]
    code = blocks[-1]
    namespace = {}
    exec(compile(code, "docs/plugins.md:parts", "exec"), namespace)
    loop, generators = namespace["loop"], namespace["generators"]
    network = loop.networks["generators"]
    # one process: the prepared model is the Parts itself; its parts by name
    assert network.model is generators and network.unwrapped is generators
    assert network.unwrapped["g_ab"] is namespace["G_AB"] and network.unwrapped["g_ba"] is namespace["G_BA"]
    assert set(network.unwrapped.state_dict()) == {"g_ab.weight", "g_ab.bias", "g_ba.weight", "g_ba.bias"}
    assert loop.state.global_step == 3 * 8  # 256 pairs, batches of 32, 3 epochs

    # again, recorded: one optimizer step per update for both parts, and both parts learn
    from hookloop.testing import reset_accelerate

    reset_accelerate()
    Parts, Cycle = namespace["Parts"], namespace["Cycle"]
    torch.manual_seed(1)
    parts = Parts({"g_ab": torch.nn.Linear(4, 4), "g_ba": torch.nn.Linear(4, 4)})
    optimizer = torch.optim.Adam(parts.parameters(), lr=1e-2)
    recorder = HookRecorder()
    a = torch.randn(64, 4)
    data = DataLoader(TensorDataset(a, a.flip(1)), batch_size=16, shuffle=True)
    loop = Loop(networks={"generators": Network(parts, optimizer)}, strategy=Cycle(), train_data=data,
                plugins=[recorder], block=["progress"])
    before = parameters(loop, "generators")
    loop.fit(epochs=1)
    assert recorder.count("after_optimizer_step") == 4 == loop.state.global_step
    assert {c["network"].name for c in recorder.calls_of("after_optimizer_step")} == {"generators"}
    after = parameters(loop, "generators")
    assert all(not torch.equal(x, y) for x, y in zip(before, after))  # every parameter of both parts
    assert len(optimizer.param_groups[0]["params"]) == 4


@pytest.mark.slow  # one two-process `accelerate launch`, ~15 s
def test_the_guide_s_several_modules_example_keeps_two_processes_in_sync(tmp_path):
    out = tmp_path / "report.json"
    proc = launching.run_two("parts_two_processes.py", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["num_processes"] == 2
    assert report["model"] == "DistributedDataParallel"  # the forward runs through the wrapper
    assert report["batches_differ"] and report["moved"], report
    assert report["identical"], report  # gradients synchronised: the ranks agree
    assert report["steps"] == 8  # 128 pairs over 2 ranks, batches of 16, 2 epochs


# -- a class where an instance belongs -------------------------------------------------------


def _data():
    return DataLoader(TensorDataset(torch.randn(8, 2), torch.randint(0, 2, (8,))), batch_size=4)


@pytest.mark.parametrize("kwargs, expected", [
    (lambda m: {"model": torch.nn.Linear, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1)},
     "model= is the class torch.nn.modules.linear.Linear, not an instance: pass model=Linear(...)"),
    (lambda m: {"model": m, "optimizer": torch.optim.Adam},
     "optimizer= is the class torch.optim.adam.Adam, not an instance: "
     "pass optimizer=Adam(model.parameters(), ...)"),
    (lambda m: {"networks": {"model": Network(m, torch.optim.Adam)}},
     "network 'model': optimizer is the class torch.optim.adam.Adam, not an instance: pass Adam(...)"),
    (lambda m: {"networks": {"model": Network}},
     "networks['model'] is the class hookloop.network.Network, not an instance"),
    (lambda m: {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=0.1), "strategy": GAN},
     "strategy= is the class hookloop.strategies.gan.GAN, not a strategy: pass strategy=GAN(...)"),
])
def test_a_class_given_where_an_instance_belongs_is_refused_naming_the_class(kwargs, expected):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        Loop(train_data=_data(), **kwargs(m))
    assert expected in str(info.value)
    assert "'type'" not in str(info.value) and "a type" not in str(info.value)
