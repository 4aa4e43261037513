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
