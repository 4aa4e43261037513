"""torch.compile and checkpoints: users compile to train and evaluate or serve
the eager model. A compiled run's checkpoint loads into the eager model and an
eager run's into the compiled one, both ways, the weights alone or a whole
resume (optimizer and scheduler included), bit for bit; the weights are
written under the eager model's tensor names whoever trained them; and a
checkpoint of hookloop 0.4.0.dev0, whose compiled runs wrote the names with
``_orig_mod.``, still loads. ``backend="eager"``: compiled, with no C
compiler, and the same numbers as the eager model on the CPU."""

import json
import shutil
import zlib

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.checkpointing.manifest import manifest_crc
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate

#: the eager model's tensor names (Sequential: Linear, ReLU, Dropout, Linear)
NAMES = ["0.bias", "0.weight", "3.bias", "3.weight"]
EPOCHS = 2  # 8 updates an epoch


def job(kind, root=None, resume_from=None, asynchronous=False):
    """A seeded run of a small MLP with dropout, Adam and a LambdaLR, its
    model as ``kind`` says: ``"eager"``; ``"compiled"`` (``torch.compile`` of
    the whole model); ``"regions"`` (each Linear compiled, as Accelerate's
    regional compilation does: ``_orig_mod`` inside the names). Returns the
    loop and the eager module (the compiled one's ``_orig_mod``)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # (ran_compiled: this run's graphs)
    reset_accelerate()
    set_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 3))
    data = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    trained = model
    if kind == "compiled":
        trained = torch.compile(model, backend="eager")
    elif kind == "regions":
        for i in (0, 3):
            model[i] = torch.compile(model[i], backend="eager")
    plugins = [Checkpoint(dir=root, every_steps=4, keep_last=None, signals=None,
                          asynchronous=asynchronous)] if root is not None else []
    loop = Loop(model=trained, optimizer=optimizer, scheduler=scheduler, train_data=data, plugins=plugins,
                block=["progress"], resume_from=resume_from)
    return loop, model


def parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def optimizer_tensors(loop):
    state = loop.networks["model"].optimizer.state_dict()["state"]
    return [(i, k, v.clone()) for i, entry in sorted(state.items()) for k, v in sorted(entry.items())]


def assert_equal(got, expected):
    assert len(got) == len(expected)
    for n, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"tensor #{n} differs"


_reference = {}


def uninterrupted():
    """The eager run, trained through without a checkpoint."""
    if "params" not in _reference:
        loop, model = job("eager")
        loop.fit(epochs=EPOCHS)
        _reference["params"] = parameters(model)
        loop.close()
    return _reference["params"]


def trained_for_four_updates(kind, root):
    """``kind``'s run to update 4, checkpointed there; its parameters and
    optimizer state then."""
    loop, model = job(kind, root)
    loop.fit(max_steps=4)
    out = parameters(model), optimizer_tensors(loop)
    loop.close()
    return out


def ran_compiled():
    """Whether the last :func:`job`'s model ran compiled."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"] >= 1


@pytest.mark.parametrize("kind,asynchronous", [("compiled", False), ("compiled", True), ("regions", False)])
def test_the_weights_are_written_under_the_eager_models_names_whoever_trained_them(tmp_path, kind, asynchronous):
    loop, model = job(kind, tmp_path, asynchronous=asynchronous)
    loop.fit(max_steps=4)
    expected = parameters(model)
    loop.close()
    saved = load_file(tmp_path / "step-00000004" / "model.safetensors")
    assert sorted(saved) == NAMES  # as accelerator.save_model and the eager model name them
    assert_equal([saved[k] for k in ("0.weight", "0.bias", "3.weight", "3.bias")], expected)
    # so the eager model takes them as they are, without hookloop (a serving script)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(16, 3))
    eager.load_state_dict(saved)
    assert_equal(parameters(eager), expected)


@pytest.mark.parametrize("source,target", [("compiled", "eager"), ("eager", "compiled"),
                                           ("regions", "eager"), ("eager", "regions")])
def test_the_weights_alone_load_across_compilation(tmp_path, source, target):
    expected, _ = trained_for_four_updates(source, tmp_path)
    loop, model = job(target)
    before = parameters(model)
    assert loop.load_checkpoint(tmp_path / "step-00000004", weights_only=True) == tmp_path / "step-00000004"
    assert_equal(parameters(model), expected)
    assert any(not torch.equal(a, b) for a, b in zip(before, expected))  # (it did change them)
    assert loop.state.global_step == 0  # a new run from the weights


@pytest.mark.parametrize("source,target", [("compiled", "eager"), ("eager", "compiled")])
def test_a_resume_across_compilation_continues_bit_for_bit(tmp_path, source, target):
    expected_params, expected_optimizer = trained_for_four_updates(source, tmp_path)
    loop, model = job(target, tmp_path, resume_from="latest")
    assert loop.resumed_from == tmp_path / "step-00000004"
    assert_equal(parameters(model), expected_params)
    # the optimizer state goes by parameter index: the same whatever the names
    got = optimizer_tensors(loop)
    assert [(i, k) for i, k, _ in got] == [(i, k) for i, k, _ in expected_optimizer]
    assert_equal([v for *_, v in got], [v for *_, v in expected_optimizer])
    loop.fit(epochs=EPOCHS)
    assert ran_compiled() == (target == "compiled")
    # compiled with backend="eager", the numbers are the eager model's: the
    # resumed run ends where the uninterrupted eager run does
    assert_equal(parameters(model), uninterrupted())


def _as_written_by_0_4_dev(checkpoint):
    """Rewrite ``model.safetensors`` under the compiled model's names, as
    hookloop 0.4.0.dev0 wrote a compiled run's, the manifest agreeing."""
    rel = "model.safetensors"
    state = load_file(checkpoint / rel)
    save_file({k if k.startswith("_orig_mod.") else f"_orig_mod.{k}": v.contiguous() for k, v in state.items()},
              checkpoint / rel, {"format": "pt"})
    data = (checkpoint / rel).read_bytes()
    doc = json.loads((checkpoint / "hookloop.json").read_text())
    doc["files"][rel], doc["crc32"][rel] = len(data), zlib.crc32(data)
    doc["manifest_crc32"] = manifest_crc(doc)
    (checkpoint / "hookloop.json").write_text(json.dumps(doc))


def test_a_compiled_runs_checkpoint_of_0_4_dev_still_loads_both_ways(tmp_path):
    expected, _ = trained_for_four_updates("compiled", tmp_path / "source")
    checkpoint = tmp_path / "source" / "step-00000004"
    _as_written_by_0_4_dev(checkpoint)
    assert sorted(load_file(checkpoint / "model.safetensors")) == [f"_orig_mod.{k}" for k in NAMES]

    loop, model = job("eager")
    loop.load_checkpoint(checkpoint, weights_only=True)
    assert_equal(parameters(model), expected)
    loop.close()
    for target in ("eager", "compiled"):  # each in a root of its own, holding only that checkpoint
        shutil.copytree(checkpoint, tmp_path / target / checkpoint.name)
        loop, model = job(target, tmp_path / target, resume_from=tmp_path / target / checkpoint.name)
        assert_equal(parameters(model), expected)
        loop.fit(epochs=EPOCHS)
        assert_equal(parameters(model), uninterrupted())
        loop.close()
