"""Streams are checkpointed and resumed exactly: a train_data without a
length, by replaying it to the saved batch (a plain DataLoader) or from the
loader's own state (torchdata's StatefulDataLoader, which uses a
``datasets.IterableDataset``'s ``state_dict``). Kill -9 of such runs is in
test_resume_kill.py and test_resume_distributed.py; here, in one process, a
Hugging Face ``datasets`` stream read from a local file."""

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from hookloop import Loop
from hookloop.checkpointing import read_manifest
from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate

datasets = pytest.importorskip("datasets")


@pytest.fixture
def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    g = torch.Generator().manual_seed(1)
    with path.open("w") as f:
        for _ in range(64):
            f.write(json.dumps({"x": torch.randn(8, generator=g).tolist(),
                                "label": int(torch.randint(0, 3, (1,), generator=g))}) + "\n")
    return path


def collate(rows):
    return torch.tensor([r["x"] for r in rows]), torch.tensor([r["label"] for r in rows])


def run(rows, root, *, shuffle, stateful, resume=None, **fit):
    reset_accelerate()
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 3))
    stream = datasets.load_dataset("json", data_files=str(rows), split="train", streaming=True)
    if shuffle:
        stream = stream.shuffle(seed=0, buffer_size=16)  # reshuffled every epoch (set_epoch)
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = StatefulDataLoader(stream, batch_size=8, collate_fn=collate)
    else:
        data = DataLoader(stream, batch_size=8, collate_fn=collate)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful))
    loop = Loop(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                train_data=data, accelerator=accelerator, block=["progress"], resume_from=resume,
                plugins=[Checkpoint(dir=root, every_steps=3, signals=None)])
    loop.fit(**fit)
    loop.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), loop


@pytest.mark.parametrize("shuffle, stateful", [(True, False), (False, True)],
                         ids=["shuffled stream, replayed", "stream, StatefulDataLoader state"])
def test_a_datasets_stream_resumed_mid_epoch_ends_bit_for_bit_equal(rows, tmp_path, shuffle, stateful):
    whole, loop = run(rows, tmp_path / "whole", shuffle=shuffle, stateful=stateful, epochs=3)
    assert loop.state.global_step == 24  # 64 rows, batches of 8: 8 updates an epoch
    run(rows, tmp_path / "cut", shuffle=shuffle, stateful=stateful, max_steps=13)  # mid-epoch 1
    doc = read_manifest(tmp_path / "cut" / "step-00000013")
    assert doc["loop"]["step_in_epoch"] == 5 and doc["settings"]["batches_per_epoch"] is None
    assert ("dl_state_dict.bin" in doc["files"]) == stateful  # the loader's own position
    resumed, loop = run(rows, tmp_path / "cut", shuffle=shuffle, stateful=stateful,
                        resume="latest", epochs=3)
    assert loop.resumed_from.name == "step-00000013" and loop.state.global_step == 24
    assert torch.equal(resumed, whole)


def test_without_the_replay_the_resume_differs(rows, tmp_path, monkeypatch):
    """The equality above means something: a resume that starts the stream
    afresh instead of replaying it to the saved batch ends elsewhere."""
    from hookloop import rng

    whole, _ = run(rows, tmp_path / "whole", shuffle=True, stateful=False, epochs=3)
    run(rows, tmp_path / "cut", shuffle=True, stateful=False, max_steps=13)
    monkeypatch.setattr(rng.Resume, "batches",
                        lambda self, accelerator, data, skip, **options: self.restore_now(data) or data)
    resumed, _ = run(rows, tmp_path / "cut", shuffle=True, stateful=False, resume="latest", epochs=3)
    assert not torch.equal(resumed, whole)
