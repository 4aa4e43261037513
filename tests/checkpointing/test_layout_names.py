"""Names the checkpoint layout reads: one that is not a checkpoint's or a run
folder's is refused with its name, not an AttributeError on None."""

from pathlib import Path

import pytest

from hookloop.checkpointing import sort_key


def test_checkpoints_sort_by_step_an_epoch_end_after_the_mid_epoch_one():
    names = ["step-00000010-epoch-end", "step-00000002", "step-00000010", "step-00000010.1"]
    assert [p.name for p in sorted(map(Path, names), key=sort_key)] == [
        "step-00000002", "step-00000010", "step-00000010.1", "step-00000010-epoch-end"]


def test_a_folder_that_is_not_a_checkpoint_is_refused_by_name():
    with pytest.raises(ValueError, match=r"notes: not a checkpoint's name \(step-<N>"):
        sort_key(Path("runs/notes"))
