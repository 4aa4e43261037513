"""The GAN demo, its image plugin and its quality measure.

Fast tests: ~10 s together (short demo runs of 1-2 epochs; the judge trains
in about a second each time). The full default run is slow-marked (about a
minute on 2 cores).
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.utils import set_seed
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network
from hookloop.cli import main as cli_main
from hookloop.examples import gan_digits
from hookloop.examples.digits_quality import DigitJudge, frechet_distance, load_real_digits
from hookloop.plugins import BUILTINS, SampleGrid
from hookloop.strategies import GAN

# a short demo: a few seconds, all the files a full run writes
SHORT = ["--epochs", "2", "--hidden", "64", "--samples", "400", "--quality-every", "1",
         "--log-every", "5", "--no-progress"]


# -- the image plugin ---------------------------------------------------------------


def tiny_gan(plugins, side=4):
    set_seed(0)
    G = torch.nn.Sequential(torch.nn.Linear(3, side * side), torch.nn.Tanh())
    D = torch.nn.Linear(side * side, 1)
    data = DataLoader(TensorDataset(torch.rand(32, side * side) * 2 - 1), batch_size=16)
    return Loop(
        networks={"generator": Network(G, torch.optim.Adam(G.parameters(), lr=0.05)),
                  "discriminator": Network(D, torch.optim.Adam(D.parameters(), lr=0.05))},
        strategy=GAN(latent_dim=3), train_data=data, plugins=plugins, block=["progress"],
    )


def test_sample_grid_writes_one_grid_per_epoch_from_fixed_latents(tmp_path):
    grid = SampleGrid(tmp_path / "s", n=4, nrow=2, scale=3)
    loop = tiny_gan([grid])
    loop.fit(epochs=2)
    names = ["epoch-000.png", "epoch-001.png", "epoch-002.png"]
    assert [p.rsplit("/", 1)[-1] for p in grid.paths] == names
    images = [np.asarray(Image.open(tmp_path / "s" / n)) for n in names]
    # 2x2 cells of 4x4 pixels, 1 pixel of padding around each, times 3
    assert all(im.shape == ((2 * 5 + 1) * 3,) * 2 for im in images)
    assert not np.array_equal(images[0], images[2])  # training changed the samples
    # the same latent vectors every time: drawn once, from the seed, by the strategy
    expected = loop.strategy.sample_latent(4, torch.Generator().manual_seed(0))
    assert torch.equal(grid.latent, expected)
    G = loop.networks["generator"].unwrapped
    rng = torch.get_rng_state()
    again = np.asarray(grid.render(loop))
    assert np.array_equal(again, images[2])
    assert torch.equal(torch.get_rng_state(), rng) and G.training  # no side effects


def test_sample_grid_is_a_builtin_and_writes_on_the_main_process_only(tmp_path):
    assert BUILTINS["samples"] is SampleGrid
    grid = SampleGrid(tmp_path)
    not_main = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=False))
    assert grid.write(not_main, "x.png") is None
    assert list(tmp_path.iterdir()) == []


def test_sample_grid_needs_a_shape_for_non_square_samples(tmp_path):
    loop = tiny_gan([], side=4)
    with pytest.raises(ValueError, match="image_shape"):
        SampleGrid(tmp_path, n=2, image_shape=None).render(
            SimpleNamespace(networks={"generator": SimpleNamespace(
                unwrapped=torch.nn.Linear(3, 15))}, strategy=loop.strategy))
    image = SampleGrid(tmp_path, n=2, nrow=2, image_shape=(1, 3, 5), scale=1).render(
        SimpleNamespace(networks={"generator": SimpleNamespace(unwrapped=torch.nn.Linear(3, 15))},
                        strategy=loop.strategy))
    assert image.size == (2 * 6 + 1, 3 + 2)


# -- the quality measure --------------------------------------------------------------


def test_frechet_distance_matches_the_closed_form():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6))
    shift = np.arange(6.0)
    b = 2 * a + shift  # cov_b = 4 cov_a, so tr(S_a + S_b - 2 (S_a S_b)^1/2) = tr(S_a)
    expected = np.sum((a.mean(0) - b.mean(0)) ** 2) + np.trace(np.cov(a, rowvar=False))
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-6)
    assert frechet_distance(a, a) == pytest.approx(0, abs=1e-6)


def test_judge_knows_digits_from_noise():
    judge = DigitJudge(seed=0)
    assert judge.accuracy > 0.95
    real, _ = load_real_digits()
    q_real = judge.quality(real)
    q_noise = judge.quality(torch.rand(1000, 64) * 2 - 1)
    assert q_real["coverage"] == 10 and q_real["frechet"] < 1e-3
    assert q_noise["frechet"] > 50 * judge.real_floor
    assert q_noise["recognisable"] < 0.5 < q_real["recognisable"]
    # a generator that draws one digit only covers one
    zeros = real[load_real_digits()[1] == 0]
    assert judge.quality(zeros)["coverage"] == 1


# -- the demo ----------------------------------------------------------------------------


def test_short_demo_writes_pictures_log_and_quality(tmp_path, capsys):
    out = tmp_path / "run"
    assert gan_digits.main([*SHORT, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    samples = sorted(p.name for p in (out / "samples").iterdir())
    assert samples == ["epoch-000.png", "epoch-001.png", "epoch-002.png"]
    assert Image.open(out / "samples" / "epoch-002.png").size == (546, 546)  # 10x10 digits, x6
    assert (out / "progress.png").exists()
    for path in (out / "samples" / "epoch-000.png", out / "logs" / "gan-digits.jsonl", out / "quality.json"):
        assert str(path) in printed
    assert "Fréchet distance" in printed and "untrained generator" in printed
    # each Fréchet distance says how many samples it measured: the progress lines
    # 1000, the final table --samples (400 here), and quality.json records both
    assert "after   1 epochs: Fréchet distance (1000 samples)" in printed
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["Fréchet", "distance", "digits",
                                                                        "covered", "recognisable"])
    assert lines[header + 1].strip() == "(400 samples)"
    assert "400 generated digits against" in printed and "lines judge 1000 samples" in printed

    records = [json.loads(line) for line in (out / "logs" / "gan-digits.jsonl").read_text().splitlines()]
    assert records[0]["config"]["epochs"] == 2
    steps = [r for r in records if "loss/generator" in r]
    assert len(steps) == 2 * 28 // 5  # every 5 steps, 28 batches an epoch
    assert {"loss/discriminator", "grad_norm/generator", "grad_norm/discriminator",
            "lr/generator", "lr/discriminator"} <= set(steps[0])
    assert [r["epoch"] for r in records if "frechet" in r] == [0, 1]

    report = json.loads((out / "quality.json").read_text())
    assert report["steps"] == 56
    assert report["frechet_samples"] == {"generated": 400, "real": 1797,
                                         "real_halves": [898, 899], "progress": 1000}
    for key in ("trained", "untrained", "real"):
        assert set(report[key]) >= {"frechet", "coverage", "recognisable", "shares"}
    # even two epochs move the generator toward the digits
    assert report["trained"]["frechet"] < report["untrained"]["frechet"]


def test_hookloop_demo_runs_the_gan_and_starts_clean(tmp_path):
    out = tmp_path / "run"
    gan_digits.main([*SHORT, "--out", str(out)])
    assert cli_main(["demo", "gan", *SHORT, "--epochs", "1", "--out", str(out)]) == 0
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["epoch-000.png", "epoch-001.png"]
    lines = (out / "logs" / "gan-digits.jsonl").read_text().splitlines()
    assert sum("config" in line for line in lines) == 1  # the earlier run's log is gone


def readme_checks():
    """tests/docs/test_readme.py, the checks of docs/demos.md's figures, loaded
    by path: tests/docs is on sys.path only when pytest collects it too."""
    import importlib.util

    from paths import ROOT

    spec = importlib.util.spec_from_file_location("demos_md_checks", ROOT / "tests" / "docs" / "test_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_default_demo_quality(tmp_path):
    """docs/demos.md's numbers: the full default run is held to what
    docs/demos.md says `hookloop demo` prints."""
    held_to_the_readme = readme_checks().held_to_the_readme

    report = gan_digits.run(["--out", str(tmp_path), "--no-progress"])
    trained, untrained = report["trained"], report["untrained"]
    assert trained["coverage"] >= 8, report
    assert trained["frechet"] < untrained["frechet"] / 10, report
    held_to_the_readme(report)


def test_the_readme_check_catches_drifted_figures():
    """The check above fails on figures docs/demos.md does not state."""
    import json as _json

    checks = readme_checks()
    gan_figures, held_to_the_readme = checks.gan_figures, checks.held_to_the_readme

    rows, ranges = gan_figures()
    report = {"trained": dict(rows["trained"]), "untrained": dict(rows["untrained"]),
              "real": dict(rows["real"]), "judge_accuracy": ranges["judge"]}
    held_to_the_readme(_json.loads(_json.dumps(report)))  # the documented figures pass
    for key, value in (("frechet", ranges["frechet"][1] + 2), ("recognisable", 0.5), ("coverage", 7)):
        drifted = {**report, "trained": {**report["trained"], key: value}}
        with pytest.raises(AssertionError):
            held_to_the_readme(drifted)
