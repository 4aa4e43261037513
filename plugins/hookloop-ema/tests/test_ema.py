"""hookloop-ema, tested with hookloop's kit (fixtures ``tiny_loop``,
``tiny_gan_loop``, ``hookloop_recorder``; ``hookloop.testing.parameters``).

Run after installing the distribution: ``pip install ./plugins/hookloop-ema``
then ``pytest plugins/hookloop-ema/tests``.
"""

import pytest
import torch

from hookloop import hookimpl
from hookloop.testing import parameters
from hookloop_ema import EMA


class Weights:
    """The weights at the start of training and after every optimizer step."""

    name = "weights"

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_fit_start(self, loop):
        self.seen.append(parameters(loop))

    @hookimpl
    def after_optimizer_step(self, loop):
        self.seen.append(parameters(loop))


class EvalWeights:
    """The weights the model holds while it is evaluated."""

    name = "eval-weights"

    def __init__(self):
        self.seen = []

    @hookimpl
    def on_eval_start(self, loop):
        if loop.state.stage != "sanity":  # the sanity check runs before any average exists
            self.seen.append(parameters(loop))


def hand_average(snapshots, decay, start=None):
    """average = decay * average + (1 - decay) * weights, in float64, from the
    first snapshot (or ``start``) on."""
    avg = [p.double() for p in (start if start is not None else snapshots[0])]
    for weights in snapshots[1 if start is None else 0:]:
        avg = [decay * a + (1 - decay) * w.double() for a, w in zip(avg, weights)]
    return avg


def assert_close_to(averages, expected):
    assert len(averages) == len(expected)
    for got, want in zip(averages, expected):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_the_average_after_n_steps_is_the_hand_computed_one(tiny_loop):
    weights, ema = Weights(), EMA(decay=0.9)
    loop = tiny_loop([weights, ema])
    loop.fit(max_steps=5)
    assert len(weights.seen) == 6 and ema.updates == {"model": 5}
    averages = list(ema.average("model").values())
    assert_close_to(averages, hand_average(weights.seen, 0.9))
    # it is neither the first nor the last weights
    assert not torch.allclose(averages[0], weights.seen[-1][0])
    assert not torch.allclose(averages[0], weights.seen[0][0])


def test_evaluation_runs_on_the_averages_and_training_is_unchanged(tiny_loop):
    plain = tiny_loop(eval_data=True)
    plain_metrics = plain.fit(epochs=2)

    ema, seen = EMA(decay=0.8), EvalWeights()
    loop = tiny_loop([ema, seen], eval_data=True)
    metrics = loop.fit(epochs=2)
    # training itself is untouched: the same weights, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(parameters(loop), parameters(plain)))
    # but each evaluation saw the averages
    assert len(seen.seen) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen.seen[-1], ema.average("model").values()))
    assert metrics != plain_metrics
    # and afterwards the model holds the trained weights again
    assert all(torch.equal(a, b) for a, b in zip(parameters(loop), parameters(plain)))


def test_evaluate_false_keeps_the_averages_without_using_them(tiny_loop):
    plain = tiny_loop(eval_data=True)
    plain_metrics = plain.fit(epochs=1)
    ema = EMA(decay=0.8, evaluate=False)
    loop = tiny_loop([ema], eval_data=True)
    assert loop.fit(epochs=1) == plain_metrics
    with ema.applied(loop):
        assert all(torch.equal(a, b) for a, b in zip(parameters(loop), ema.average("model").values()))
        assert loop.evaluate() != plain_metrics
    assert all(torch.equal(a, b) for a, b in zip(parameters(loop), parameters(plain)))


def test_one_average_per_network_and_a_choice_of_networks(tiny_gan_loop):
    both = EMA(decay=0.5)
    loop = tiny_gan_loop([both])
    loop.fit(max_steps=3)
    assert both.updates == {"generator": 3, "discriminator": 3}

    only_g = EMA(decay=0.5, networks=["generator"])
    tiny_gan_loop([only_g]).fit(max_steps=3)
    assert set(only_g.shadow) == {"generator"}
    # same seed, same run: the generator's average is the same either way
    assert all(torch.equal(a, b) for a, b in zip(only_g.average("generator").values(),
                                                   both.average("generator").values()))


def test_an_unknown_network_is_named(tiny_gan_loop):
    loop = tiny_gan_loop([EMA(networks=["critic"])])
    with pytest.raises(Exception, match="no network named 'critic'.*'generator', 'discriminator'"):
        loop.fit(max_steps=1)


def test_state_dict_round_trip_continues_the_average(tiny_loop, tmp_path):
    """What a checkpoint does with plugin state: save, load into a fresh
    plugin in a fresh loop; the average continues instead of restarting."""
    first, weights = EMA(decay=0.9), Weights()
    loop = tiny_loop([first, weights])
    loop.fit(max_steps=3)
    torch.save(first.state_dict(), tmp_path / "ema.pt")

    resumed, more = EMA(decay=0.5), Weights()  # decay comes back from the checkpoint
    resumed.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=False))
    loop2 = tiny_loop([resumed, more], seed=1)  # other initial weights: must not reset
    loop2.fit(max_steps=2)
    assert resumed.decay == 0.9 and resumed.updates == {"model": 5}
    saved = list(first.average("model").values())
    assert_close_to(list(resumed.average("model").values()),
                    hand_average(more.seen[1:], 0.9, start=saved))


def test_a_checkpoint_for_another_model_is_refused(tiny_loop):
    ema = EMA()
    ema.load_state_dict({"decay": 0.9, "updates": {"model": 1},
                         "shadow": {"model": {"0.weight": torch.zeros(16, 8)}}})
    loop = tiny_loop([ema])
    with pytest.raises(Exception, match="does not match its parameters"):
        loop.fit(max_steps=1)


def test_installed_it_is_switched_on_by_name_with_options(tiny_loop):
    loop = tiny_loop([("ema", {"decay": 0.5})])
    plugin = loop.plugins.get("ema")
    assert isinstance(plugin, EMA) and plugin.decay == 0.5
    assert "ema" not in tiny_loop().plugins.names()  # installed is not switched on


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9"])
def test_a_bad_decay_is_refused(decay):
    with pytest.raises(ValueError, match="decay must be a number in"):
        EMA(decay=decay)


def test_the_average_comes_back_after_a_resume(tiny_loop, tmp_path):
    """Through hookloop's checkpoint plugin, which saves every plugin that has
    state_dict/load_state_dict under its name."""
    try:
        from hookloop.plugins import Checkpoint
    except ImportError:
        pytest.skip("this hookloop has no checkpoint plugin")
    uninterrupted = EMA(decay=0.9)
    tiny_loop([uninterrupted]).fit(max_steps=6)

    first = EMA(decay=0.9)
    tiny_loop([first, Checkpoint(dir=tmp_path, every_steps=3, signals=None)]).fit(max_steps=3)
    resumed = EMA(decay=0.9)
    loop = tiny_loop([resumed, Checkpoint(dir=tmp_path, signals=None)], resume_from="latest")
    assert resumed.updates == {"model": 3}  # restored when the loop was built
    loop.fit(max_steps=6)
    assert resumed.updates == {"model": 6}
    for a, b in zip(resumed.average("model").values(), uninterrupted.average("model").values()):
        assert torch.equal(a, b)


# -- diffusers' warm-up schedule ---------------------------------------------------------

#: train_unconditional.py's EMA, with a short delay so that the waiting steps show
WARMUP = dict(decay=0.9999, use_ema_warmup=True, inv_gamma=1.0, power=3 / 4, update_after_step=2)


@pytest.fixture
def EMAModel():
    return pytest.importorskip("diffusers.training_utils").EMAModel


class DiffusersEMA:
    """diffusers' EMAModel side by side in the same run: built from the
    weights at the start of training (or loaded from ``state``), stepped
    after every optimizer step, as train_unconditional.py does by hand."""

    name = "diffusers-ema"

    def __init__(self, cls, state=None, **kwargs):
        self.cls, self.state, self.kwargs = cls, state, kwargs
        self.ema, self.decays = None, []

    @hookimpl
    def on_fit_start(self, loop):
        self.ema = self.cls(loop.networks["model"].unwrapped.parameters(), **self.kwargs)
        if self.state is not None:
            self.ema.load_state_dict(self.state)

    @hookimpl
    def after_optimizer_step(self, loop):
        self.ema.step(loop.networks["model"].unwrapped.parameters())
        self.decays.append(self.ema.cur_decay_value)


class Decays:
    """The decay of each of the EMA plugin's updates (runs after it)."""

    name = "decays"

    def __init__(self, ema):
        self.ema, self.seen = ema, []

    @hookimpl(trylast=True)
    def after_optimizer_step(self, loop):
        self.seen.append(self.ema.current_decay["model"])


def bitwise_equal(a, b):
    a, b = list(a), list(b)
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trained", "a-frozen-bias"])
def test_the_warm_up_averages_are_diffusers_bit_for_bit(tiny_loop, EMAModel, frozen):
    ema = EMA(**WARMUP)
    reference = DiffusersEMA(EMAModel, **WARMUP)
    decays = Decays(ema)
    loop = tiny_loop([ema, reference, decays])
    if frozen:  # diffusers copies a parameter that does not require grad
        loop.networks["model"].unwrapped[0].bias.requires_grad_(False)
    loop.fit(max_steps=20)
    assert ema.updates == {"model": 20} == {"model": reference.ema.optimization_step}
    assert decays.seen == reference.decays
    assert bitwise_equal(ema.average("model").values(), reference.ema.shadow_params)
    # a real average: neither the first weights nor the last
    assert not bitwise_equal(ema.average("model").values(), parameters(loop))
    if frozen:
        assert torch.equal(ema.average("model")["0.bias"], loop.networks["model"].unwrapped[0].bias)


def test_the_decays_are_diffusers_get_decay(tiny_loop, EMAModel):
    ema = EMA(**WARMUP)
    decays = Decays(ema)
    tiny_loop([ema, decays]).fit(max_steps=8)
    reference = EMAModel([torch.zeros(1)], **WARMUP)
    assert decays.seen == [reference.get_decay(n) for n in range(1, 9)]
    assert decays.seen[:3] == [0.0, 0.0, 0.0]  # update_after_step=2, and diffusers' "- 1"
    assert decays.seen[3] == 1 - 2 ** -0.75
    # the schedule alone, over more steps and other arguments (the cap, the floor, an int gamma)
    for kwargs in (WARMUP, dict(decay=0.999), dict(decay=0.9, use_ema_warmup=True),
                   dict(decay=0.99, use_ema_warmup=True, inv_gamma=10, power=1, min_decay=0.5),
                   dict(decay=0.5, use_ema_warmup=True, power=2 / 3, update_after_step=7)):
        kwargs = {"use_ema_warmup": False, **kwargs}
        if kwargs["use_ema_warmup"]:
            reference = EMAModel([torch.zeros(1)], **kwargs)
            assert [EMA(**kwargs).get_decay(n) for n in range(1, 3000)] == \
                [reference.get_decay(n) for n in range(1, 3000)]
        else:  # hookloop's constant decay (diffusers' use_ema_warmup=False is another schedule)
            assert {EMA(**kwargs).get_decay(n) for n in range(1, 3000)} == {kwargs["decay"]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_the_warm_up_update_is_diffusers_in_each_dtype(EMAModel, dtype):
    """The update runs in the parameters' dtype, rounded as diffusers rounds
    it (driven by hand: the tiny loop trains in float32)."""
    from types import SimpleNamespace

    from hookloop import Network

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).to(dtype)
    loop = SimpleNamespace(networks={"model": Network(model, name="model")})
    ema = EMA(**WARMUP)
    ema.on_fit_start(loop=loop)
    reference = EMAModel(model.parameters(), **WARMUP)
    for _ in range(50):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ema.after_optimizer_step(loop=loop, network=loop.networks["model"])
        reference.step(model.parameters())
    assert bitwise_equal(ema.average("model").values(), reference.shadow_params)


def test_a_resume_mid_way_continues_the_schedule(tiny_loop, EMAModel, tmp_path):
    """Save the state after 5 steps, load it into a fresh EMA (default
    arguments: the schedule comes from the state), train on: the decays go on
    from step 6, and the averages are those of a diffusers EMAModel loaded
    with the same state, bit for bit."""
    first = EMA(**WARMUP)
    tiny_loop([first]).fit(max_steps=5)
    state = first.state_dict()
    assert {k: state[k] for k in ("decay", "use_ema_warmup", "inv_gamma", "power",
                                  "min_decay", "update_after_step")} == \
        {"min_decay": 0.0, **WARMUP}
    torch.save(state, tmp_path / "ema.pt")

    resumed = EMA()
    resumed.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    assert (resumed.use_ema_warmup, resumed.power, resumed.decay) == (True, 0.75, 0.9999)
    reference = DiffusersEMA(EMAModel, state={
        "optimization_step": 5, "shadow_params": list(state["shadow"]["model"].values()),
        **{k: state[k] for k in ("decay", "use_ema_warmup", "inv_gamma", "power",
                                 "min_decay", "update_after_step")}})
    decays = Decays(resumed)
    tiny_loop([resumed, reference, decays], seed=1).fit(max_steps=4)  # not a restart: continues
    assert resumed.updates == {"model": 9}
    assert decays.seen == reference.decays == [EMAModel([torch.zeros(1)], **WARMUP).get_decay(n)
                                               for n in range(6, 10)]
    assert bitwise_equal(resumed.average("model").values(), reference.ema.shadow_params)


def test_the_warm_up_comes_back_after_a_checkpoint_resume(tiny_loop, tmp_path):
    """Through hookloop's checkpoint plugin: the same averages as without the
    interruption, bit for bit."""
    try:
        from hookloop.plugins import Checkpoint
    except ImportError:
        pytest.skip("this hookloop has no checkpoint plugin")
    uninterrupted = EMA(**WARMUP)
    tiny_loop([uninterrupted]).fit(max_steps=10)

    tiny_loop([EMA(**WARMUP), Checkpoint(dir=tmp_path, every_steps=5, signals=None)]).fit(max_steps=5)
    resumed = EMA()  # the schedule comes back from the checkpoint
    loop = tiny_loop([resumed, Checkpoint(dir=tmp_path, signals=None)], resume_from="latest")
    assert resumed.updates == {"model": 5} and resumed.use_ema_warmup
    loop.fit(max_steps=10)
    assert resumed.current_decay == uninterrupted.current_decay
    assert bitwise_equal(resumed.average("model").values(), uninterrupted.average("model").values())


def test_the_constant_decay_is_unchanged_bit_for_bit(tiny_loop):
    """Without the warm-up, hookloop-ema 0.1's update: ``average * decay`` then
    ``+ (1 - decay) * weights``; ``update_after_step`` takes the weights first."""
    def v01(snapshots, decay, take=0):
        avg = [p.clone() for p in snapshots[0]]
        for n, weights in enumerate(snapshots[1:], start=1):
            d = 0.0 if n <= take else decay
            torch._foreach_mul_(avg, d)
            torch._foreach_add_(avg, weights, alpha=1.0 - d)
        return avg

    for take in (0, 3):
        ema, weights = EMA(decay=0.9, update_after_step=take), Weights()
        tiny_loop([ema, weights]).fit(max_steps=6)
        assert bitwise_equal(ema.average("model").values(), v01(weights.seen, 0.9, take))
        assert ema.current_decay == {"model": 0.9}
    assert bitwise_equal(v01(weights.seen[:4], 0.9, take=3), weights.seen[3])  # took the weights


@pytest.mark.parametrize("kwargs, message", [
    (dict(power=-0.5), r"power must be a number > 0 .*got -0\.5"),
    (dict(power=0), r"power must be a number > 0"),
    (dict(decay=0.9, min_decay=0.95), r"min_decay must be a number in \[0, decay\] = \[0, 0\.9\], got 0\.95"),
    (dict(min_decay=-0.1), r"min_decay must be a number in \[0, decay\]"),
    (dict(inv_gamma=0), r"inv_gamma must be a number > 0"),
    (dict(update_after_step=-1), r"update_after_step must be a whole number >= 0, got -1"),
    (dict(update_after_step=2.5), r"update_after_step must be a whole number >= 0, got 2\.5"),
    (dict(use_ema_warmup="yes"), r"use_ema_warmup must be True or False, got 'yes'"),
])
def test_bad_schedule_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EMA(**kwargs)


def test_a_checkpoint_with_a_bad_schedule_is_refused():
    ema = EMA(**WARMUP)
    state = {**ema.state_dict(), "power": -1.0}
    with pytest.raises(ValueError, match="power must be a number > 0"):
        EMA().load_state_dict(state)


def test_a_checkpoint_of_version_0_1_keeps_its_constant_decay():
    ema = EMA(**WARMUP)  # the checkpoint's schedule wins, as its decay does
    ema.load_state_dict({"decay": 0.9, "updates": {"model": 4}, "shadow": {"model": {}}})
    assert (ema.decay, ema.use_ema_warmup, ema.update_after_step) == (0.9, False, 0)
    assert ema.get_decay(5) == 0.9


def test_the_warm_up_is_switched_on_by_name_with_options(tiny_loop):
    loop = tiny_loop([("ema", {"decay": 0.9999, "use_ema_warmup": True, "power": 0.75})])
    plugin = loop.plugins.get("ema")
    assert (plugin.use_ema_warmup, plugin.power, plugin.inv_gamma) == (True, 0.75, 1.0)
