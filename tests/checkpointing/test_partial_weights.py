"""Fine-tuning from a checkpoint into another head: ``load_checkpoint(path,
weights_only=True, strict=False)`` loads every tensor that fits (name and
shape), leaves the others as they are, and returns (and says in a warning)
the missing, unexpected and mismatched names, as torch's
``load_state_dict(strict=False)`` and transformers'
``ignore_mismatched_sizes=True`` do."""

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop
from hookloop.checkpointing import CheckpointError, WeightsLoaded
from hookloop.plugins import Checkpoint


def classifier(classes, extra=False):
    layers = [torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, classes)]
    if extra:
        layers.append(torch.nn.Linear(classes, classes))
    return torch.nn.Sequential(*layers)


def make_loop(model, plugins=()):
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    return Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                train_data=DataLoader(TensorDataset(x, y), batch_size=8), plugins=list(plugins),
                accelerator=Accelerator(cpu=True), block=["progress"])


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    make_loop(classifier(3), [Checkpoint(dir=tmp_path, every_epoch=True)]).fit(epochs=1)
    return tmp_path / "step-00000004-epoch-end"


def test_a_new_head_loads_the_body_keeps_its_own_head_and_names_what_did_not_fit(checkpoint):
    saved = load_file(str(checkpoint / "model.safetensors"))
    torch.manual_seed(1)
    model = classifier(5)
    head = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("2.")}
    loop = make_loop(model)
    with pytest.raises(CheckpointError, match=r"tensor '2\.bias' has shape \[3\] in the checkpoint"):  # strict: refused
        loop.load_checkpoint(checkpoint, weights_only=True)
    with pytest.warns(RuntimeWarning, match=r"network 'model': another shape in the checkpoint .*2\.weight "
                                            r"\[3, 16\] in the checkpoint, \[5, 16\] in the model"):
        loaded = loop.load_checkpoint(checkpoint, weights_only=True, strict=False)
    assert isinstance(loaded, WeightsLoaded) and loaded.path == checkpoint
    assert loaded.mismatched == {"model": {"2.weight": ([3, 16], [5, 16]), "2.bias": ([3], [5])}}
    assert loaded.missing == {"model": []} and loaded.unexpected == {"model": []}
    for key, value in model.state_dict().items():
        assert torch.equal(value, head[key] if key.startswith("2.") else saved[key]), key


def test_missing_and_unexpected_tensors_as_torch_reports_them(checkpoint):
    saved = load_file(str(checkpoint / "model.safetensors"))
    torch.manual_seed(1)
    model = classifier(3, extra=True)  # one layer more: its tensors are not in the checkpoint
    reference = classifier(3, extra=True)
    reference.load_state_dict(model.state_dict())
    torch_says = reference.load_state_dict(saved, strict=False)
    loaded = make_loop(model).load_checkpoint(checkpoint, weights_only=True, strict=False)
    assert loaded.missing == {"model": torch_says.missing_keys} == {"model": ["3.weight", "3.bias"]}
    assert loaded.unexpected == {"model": torch_says.unexpected_keys}
    for (key, value), (_, same) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(value, same), key


def test_strict_false_of_a_checkpoint_that_fits_loads_everything_and_says_nothing(checkpoint, recwarn):
    torch.manual_seed(1)
    model = classifier(3)
    loaded = make_loop(model).load_checkpoint(checkpoint, weights_only=True, strict=False)
    assert loaded.differences() == "" and not [w for w in recwarn if "loaded what fits" in str(w.message)]
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
