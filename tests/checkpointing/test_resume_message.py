"""A resume says what it restored: "resumed from <checkpoint> (epoch e,
update u)", once, on the main process (the line the scripts users come from
print); nothing when there was nothing to resume."""

from accelerate import Accelerator

from hookloop.plugins import Checkpoint
from hookloop.testing import reset_accelerate, tiny_loop


def make(root, **kwargs):
    reset_accelerate()
    return tiny_loop([Checkpoint(dir=root, every_steps=2, keep_last=10, signals=None)],
                     accelerator=Accelerator(), eval_data=True, **kwargs)


def resumed_lines(out):
    return [line for line in out.splitlines() if "resumed from" in line]


def test_resume_from_latest_names_the_checkpoint_and_the_position(tmp_path, capsys):
    make(tmp_path).fit(max_steps=10)  # 8 updates an epoch: the 2nd update of epoch 1
    capsys.readouterr()
    loop = make(tmp_path, resume_from="latest")
    assert resumed_lines(capsys.readouterr().out) == [
        f"hookloop: resumed from {tmp_path / 'step-00000010'} (epoch 1, update 10)"]
    loop.load_checkpoint(tmp_path / "step-00000004")  # a named checkpoint, mid-epoch 0
    assert resumed_lines(capsys.readouterr().out) == [
        f"hookloop: resumed from {tmp_path / 'step-00000004'} (epoch 0, update 4)"]


def test_nothing_to_resume_and_weights_only_say_no_resume(tmp_path, capsys):
    make(tmp_path, resume_from="latest")
    out = capsys.readouterr().out
    assert resumed_lines(out) == [] and "starting from scratch" in out
    make(tmp_path).fit(max_steps=2)
    capsys.readouterr()
    make(tmp_path / "new").load_checkpoint(tmp_path / "step-00000002", weights_only=True)
    assert resumed_lines(capsys.readouterr().out) == []  # a new run from weights: no position restored


def test_only_the_main_process_says_it_resumed(tmp_path, monkeypatch, capsys):
    make(tmp_path).fit(max_steps=2)
    loop = make(tmp_path)
    capsys.readouterr()
    loop.load_checkpoint("latest")
    assert len(resumed_lines(capsys.readouterr().out)) == 1
    monkeypatch.setattr(type(loop.accelerator), "is_main_process", property(lambda self: False))
    loop.load_checkpoint("latest")
    assert loop.state.global_step == 2  # it did resume
    assert resumed_lines(capsys.readouterr().out) == []
