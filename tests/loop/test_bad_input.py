"""Bad input gets an error naming the culprit, and no earlier checkpoint is
damaged: every case runs next to a checkpoint directory written before, and
checks it byte for byte afterwards (and that it still resumes)."""

import hashlib
import shutil

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, Network, hookimpl
from hookloop.checkpointing import CheckpointError, read_manifest, resolve
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate


def mlp_loop(root=None, data=None, plugins=(), resume_from=None, features=8, **kwargs):
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if data is None:
        # 5 batches an epoch: fit(max_steps=4) stops in the middle of the first
        data = DataLoader(TensorDataset(torch.randn(40, features), torch.randint(0, 3, (40,))),
                          batch_size=8, shuffle=True)
    # keep_last=None: no rotation, so that any earlier file gone is damage
    checkpoint = [Checkpoint(dir=root, every_steps=1, keep_last=None, on_exception=True, signals=None)
                  ] if root else []
    return Loop(model=model, optimizer=optimizer, scheduler=LambdaLR(optimizer, lambda s: 1.0),
                train_data=data, plugins=[*checkpoint, *plugins], block=["progress"],
                resume_from=resume_from, **kwargs)


def fingerprint(root):
    """Every checkpoint file's hash (``latest`` may move on to a newer one)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.glob("step-*/*"))}


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A checkpoint root from an earlier run: step-1 ... step-4, latest."""
    root = tmp_path_factory.mktemp("earlier") / "checkpoints"
    mlp_loop(root, plugins=[]).fit(max_steps=4)
    return root


@pytest.fixture
def root(earlier, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(earlier, copy)
    before = fingerprint(copy)
    yield copy
    after = fingerprint(copy)
    damaged = [f for f, digest in before.items() if after.get(f) != digest]
    assert damaged == [], f"earlier checkpoint files changed or lost: {damaged}"
    resumed = mlp_loop(resume_from=copy / "step-00000004")
    assert resumed.state.global_step == 4
    read_manifest(resolve("latest", copy))  # latest names a complete checkpoint


def test_the_damage_check_is_sharp(earlier, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(earlier, copy)
    before = fingerprint(copy)
    (copy / "step-00000004" / "optimizer.bin").write_bytes(b"x")
    assert fingerprint(copy) != before
    shutil.rmtree(copy / "step-00000003")
    assert fingerprint(copy) != before


# -- errors during training: the run dies, the directory does not ----------------


class LossOf:
    name = "loss_of"

    def __init__(self, value):
        self.value = value

    @hookimpl
    def compute_loss(self):
        return self.value


def ints():
    return DataLoader(list(range(8)), batch_size=None)


def tensors_only():
    return DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8, collate_fn=lambda rows: torch.stack([r[0] for r in rows]))


TRAINING = {
    "batch the strategy cannot use": (
        dict(data=ints()),
        r"^the supervised strategy cannot use a batch of type int(.|\n)*\nhookloop: raised in "
        r"hook 'training_step' of plugin 'supervised' \(built-in\)$",
    ),
    "no loss and no targets": (
        dict(data=tensors_only()),
        r"^network 'model': the model returned no loss and the batch has no targets(.|\n)*"
        r"\nhookloop: raised in hook 'compute_loss' of plugin 'loss' \(built-in\)$",
    ),
    "compute_loss returns a non-tensor": (
        dict(plugins=[LossOf(0.5)]),
        r"compute_loss returned float for network 'model' \(plugin 'loss_of'\): float, not a tensor",
    ),
    "loss is NaN": (
        dict(plugins=[LossOf(torch.tensor(float("nan"), requires_grad=True))]),
        r"loss of network 'model' is nan at step 5",
    ),
}


@pytest.mark.parametrize("case", list(TRAINING))
def test_errors_during_training_name_the_culprit_and_spare_the_checkpoints(root, case):
    kwargs, message = TRAINING[case]
    if "data" in kwargs:  # other data: the run settings differ, resuming needs strict=False
        loop = mlp_loop(root, **kwargs)
        with pytest.warns(RuntimeWarning, match=r"batches_per_epoch=5 \(this run has"):
            loop.load_checkpoint("latest", strict=False)
    else:
        loop = mlp_loop(root, resume_from="latest", **kwargs)
    assert loop.state.global_step == 4
    with pytest.raises(Exception, match=message):
        loop.fit(max_steps=8)
    emergency = [p.name for p in root.iterdir() if p.name.startswith("emergency")]
    assert emergency == ([] if case == "loss is NaN" else ["emergency-step-00000004"])


# -- errors before training ---------------------------------------------------------


def test_an_empty_dataloader(root):
    empty = DataLoader(TensorDataset(torch.randn(0, 8), torch.zeros(0, dtype=torch.long)), batch_size=8)
    with pytest.raises(ValueError, match=r"train_data is empty \(0 batches\)"):
        mlp_loop(root, data=empty).fit(epochs=1)


@pytest.mark.parametrize(("epochs", "max_steps"), [(None, None), (2, 10)])
def test_epochs_and_max_steps_both_or_neither(root, epochs, max_steps):
    with pytest.raises(ValueError, match=r"fit\(\) takes exactly one of epochs=N or max_steps=N"):
        mlp_loop(root).fit(epochs=epochs, max_steps=max_steps)


def test_a_gan_without_both_networks(root):
    from hookloop.strategies import GAN

    G = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"missing 'discriminator'"):
        Loop(networks={"generator": Network(G, torch.optim.SGD(G.parameters(), lr=0.1))},
             strategy=GAN(latent_dim=2), train_data=DataLoader(torch.randn(8, 2), batch_size=4))


def test_a_gan_batch_without_a_tensor(root):
    from hookloop.strategies import GAN

    reset_accelerate()
    G, D = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    loop = Loop(networks={"generator": Network(G, torch.optim.SGD(G.parameters(), lr=0.1)),
                          "discriminator": Network(D, torch.optim.SGD(D.parameters(), lr=0.1))},
                strategy=GAN(latent_dim=2), block=["progress"],
                train_data=DataLoader([{"text": "a"}, {"text": "b"}], batch_size=2))
    with pytest.raises(Exception, match=r"GAN strategy found no tensor in a batch with keys \['text'\]"):
        loop.fit(max_steps=1)


def test_a_fresh_run_next_to_another_runs_checkpoints(root):
    loop = mlp_loop(root)  # no resume_from: its step-1 ... would replace the earlier run's
    with pytest.raises(Exception, match=r"already holds checkpoints of a run \(step-00000002, "
                                        r"step-00000003, step-00000004\).*resume_from='latest'"):
        loop.fit(max_steps=2)
    assert loop.state.global_step == 0
    assert sorted(p.name for p in root.iterdir()) == ["latest"] + [f"step-0000000{i}" for i in (1, 2, 3, 4)]


def test_an_output_directory_that_cannot_be_written(root, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    loop = mlp_loop(blocker / "checkpoints")
    with pytest.raises(Exception, match=r"cannot write checkpoints to '.*a-file/checkpoints'.*NotADirectoryError"):
        loop.fit(max_steps=2)
    assert loop.state.global_step == 0  # refused before the first step


# -- resume_from ---------------------------------------------------------------------


def test_resume_from_a_missing_directory(root):
    with pytest.raises(CheckpointError, match=r"checkpoint '.*step-00000077' does not exist"):
        mlp_loop(root, resume_from=root / "step-00000077")


def test_resume_from_a_truncated_checkpoint(root, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(root / "step-00000004", copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model.safetensors is 100 bytes but \d+ were written: "
                                              r"the checkpoint is truncated or corrupt"):
        mlp_loop(root, resume_from=copy)
    state = copy / "hookloop.json"
    state.write_text(state.read_text()[:50])
    with pytest.raises(CheckpointError, match=r"hookloop.json is not valid JSON"):
        mlp_loop(root, resume_from=copy)


def test_resume_from_a_foreign_directory(root, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"is not a hookloop checkpoint: it has no hookloop.json "
                                              r"\(it contains: notes.txt\)"):
        mlp_loop(root, resume_from=foreign)
    loop = mlp_loop()
    loop.accelerator.save_state(str(tmp_path / "plain"))
    with pytest.raises(CheckpointError, match=r"written by accelerator.save_state without hookloop"):
        mlp_loop(root, resume_from=tmp_path / "plain")


def test_resume_from_a_checkpoint_of_another_model_shape(root):
    with pytest.raises(CheckpointError, match=r"network 'model' tensor '0.weight' has shape \[16, 8\] "
                                              r"in the checkpoint but \[16, 10\] in this model"):
        mlp_loop(root, resume_from="latest", features=10)


def test_resume_from_latest_where_every_checkpoint_is_damaged(root, tmp_path):
    copy = tmp_path / "damaged"
    shutil.copytree(root, copy)
    for ckpt in copy.glob("step-*"):
        (ckpt / "optimizer.bin").write_bytes(b"")
    with pytest.warns(RuntimeWarning, match="not usable"), pytest.raises(
            CheckpointError, match=r"no usable checkpoint in .*damaged \(found step-00000001, .*, step-00000004\)"):
        mlp_loop(copy, resume_from="latest")
