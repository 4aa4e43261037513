"""Issue 11: never publish a bad checkpoint, never load one halfway.

One section per numbered point of the issue; each test failed on the code
before it (hookloop 0.1's checkpointing) and passes now.
"""

import errno
import json
import os
import re
import shutil
import signal
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, TensorDataset

from hookloop import Loop, hookimpl
from hookloop import checkpointing
from hookloop.checkpointing import CheckpointError, codec, read_manifest, writer
from hookloop.checkpointing.manifest import manifest_crc
from hookloop.plugins import Checkpoint, GradClip
from hookloop.preemption import PREEMPTED_EXIT_CODE, Preempted
from hookloop.testing import reset_accelerate, tiny_loop
from paths import ROOT, SCRIPTS  # noqa: F401


def make(root, *plugins, resume_from=None, every_steps=2, keep_last=3, accum=1, **kwargs):
    """tiny_loop (Adam, a warm-up schedule, 8 batches an epoch) with a Checkpoint in ``root``."""
    reset_accelerate()
    checkpoint = Checkpoint(dir=root, every_steps=every_steps, keep_last=keep_last, signals=None)
    return tiny_loop([checkpoint, *plugins], accelerator=Accelerator(gradient_accumulation_steps=accum),
                     resume_from=resume_from, **kwargs)


def build(root=None, *plugins, optimizer="adam", frozen_first=False, resume_from=None, scheduler=True,
          **checkpoint):
    """A small MLP loop whose optimizer and trainable layers can be chosen."""
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    if frozen_first:
        model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.Adam(params, lr=1e-2) if optimizer == "adam"
           else torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=8,
                      shuffle=True)
    ckpt = [Checkpoint(dir=root, signals=None, **checkpoint)] if root is not None else []
    sched = LambdaLR(opt, lambda s: 1.0) if scheduler else None
    return Loop(model=model, optimizer=opt, scheduler=sched, train_data=data,
                plugins=[*ckpt, *plugins], block=["progress"], resume_from=resume_from)


def params(loop):
    return {k: v.detach().clone() for k, v in loop.networks["model"].unwrapped.state_dict().items()}


def differing(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


def original(exc):
    """The error itself (hookloop 0.1 wrapped errors from hooks in HookError)."""
    return getattr(exc, "exception", exc)


def tree(root):
    return sorted(p.name for p in Path(root).iterdir())


def rewrite(ckpt, rel, data: bytes):
    """Replace ``rel`` and make the manifest agree (size, checksum), as if the
    file had been written so: only reading its content can tell."""
    ckpt = Path(ckpt)
    (ckpt / rel).write_bytes(data)
    doc = json.loads((ckpt / "hookloop.json").read_text())
    doc["files"][rel] = len(data)
    if "crc32" in doc:
        doc["crc32"][rel] = zlib.crc32(data)
        doc["manifest_crc32"] = manifest_crc(doc)
    (ckpt / "hookloop.json").write_text(json.dumps(doc))


def flip_byte(file, from_end=12):
    data = bytearray(Path(file).read_bytes())
    data[-from_end] ^= 0x01  # inside the last tensor's data: the same size, other numbers
    Path(file).write_bytes(bytes(data))


# -- 1. non-finite weights are never published --------------------------------------


class NaNGradAt:
    """Makes one gradient NaN in update ``at``; the loss stays finite."""

    name = "nan_grad"

    def __init__(self, at):
        self.at = at

    @hookimpl
    def after_backward(self, loop, network):
        if loop.state.global_step + 1 == self.at:
            with torch.no_grad():
                next(network.model.parameters()).grad[0, 0] = float("nan")


def test_a_nan_gradient_is_never_saved_and_the_last_finite_checkpoint_survives(tmp_path):
    # update 6 turns the weights NaN; its loss was finite, so FiniteCheck sees nothing, and
    # the save after it (every 2 updates, keep_last=1) would rotate step-4 away
    loop = make(tmp_path, NaNGradAt(6), GradClip(max_norm=1.0), keep_last=1)
    with pytest.raises(Exception) as info:
        loop.fit(epochs=2)
    error = original(info.value)
    assert isinstance(error, checkpointing.NonFiniteCheckpoint), repr(error)
    message = str(error)
    assert "refusing to save checkpoint step-00000006 after step 6: network 'model' parameter" in message
    assert "first went bad at update 6 (GradClip: the gradient norm of network 'model' was nan)" in message
    assert "still names step-00000004, the last finite checkpoint" in message
    assert error.first_bad[0] == 6 and error.network == "model"
    assert tree(tmp_path) == ["latest", "step-00000004"]
    resumed = make(tmp_path, resume_from="latest")
    assert resumed.state.global_step == 4
    assert all(v.isfinite().all() for v in params(resumed).values())


def test_without_gradclip_the_refusal_says_where_to_learn_the_step(tmp_path):
    loop = make(tmp_path, NaNGradAt(2))
    with pytest.raises(Exception) as info:
        loop.fit(epochs=1)
    assert "GradClip(max_norm=...) records the first update" in str(original(info.value))
    assert tree(tmp_path) == []  # no checkpoint at all: none was finite


def test_the_finiteness_check_confirms_overflowing_norms():
    big = torch.full((8,), 3e38)  # finite; its 2-norm overflows to inf
    bad = torch.ones(5)
    bad[3] = float("inf")
    assert checkpointing.first_nonfinite([torch.zeros(3), big]) is None
    assert checkpointing.first_nonfinite([big, torch.zeros(2, dtype=torch.float64), bad]) == 2
    assert checkpointing.first_nonfinite([torch.tensor([float("nan")], dtype=torch.bfloat16)]) == 0


def test_a_nan_checkpoint_written_before_is_skipped_by_latest(tmp_path):
    """A checkpoint whose save did not check finiteness (no ``checks`` in its
    manifest: a hand-made one, or a writer that skipped it) is checked when read."""
    make(tmp_path, keep_last=None).fit(max_steps=4)
    from safetensors.torch import load_file, save_file

    file = tmp_path / "step-00000004" / "model.safetensors"
    weights = load_file(file)
    weights["0.weight"][0, 0] = float("nan")
    save_file(weights, file, metadata={"format": "pt"})
    doc = json.loads((file.parent / "hookloop.json").read_text())
    del doc["checks"]
    (file.parent / "hookloop.json").write_text(json.dumps(doc))
    rewrite(file.parent, file.name, file.read_bytes())
    with pytest.warns(RuntimeWarning, match=r"model.safetensors holds non-finite values \(tensor '0.weight'"):
        loop = make(tmp_path, resume_from="latest")
    assert loop.resumed_from.name == "step-00000002"


# -- 2. rotation deletes only this run's checkpoints ----------------------------------


def test_resuming_from_elsewhere_never_deletes_another_directorys_checkpoints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make(a, keep_last=None).fit(max_steps=6)
    shutil.copytree(a, b)  # b: copies, not written there
    before = {p.name: p.stat().st_mtime_ns for p in b.rglob("*")}
    loop = make(b, resume_from=a / "step-00000004", every_steps=1, keep_last=1)
    with pytest.raises(CheckpointError, match=r"holds checkpoints that are not this run's "
                                              r"\(step-00000002, step-00000004, step-00000006; run \w{8}\)"
                                              r".*in another directory"):
        loop.fit(max_steps=8)
    assert {p.name: p.stat().st_mtime_ns for p in b.rglob("*")} == before


def test_a_resumed_run_keeps_its_id_and_leaves_another_runs_checkpoint_alone(tmp_path):
    other, root = tmp_path / "other", tmp_path / "run"
    make(other).fit(max_steps=2)
    make(root, every_steps=1, keep_last=None).fit(max_steps=1)
    shutil.copytree(other / "step-00000002", root / "step-00000000")  # another run's, older
    run_id = read_manifest(root / "step-00000001")["run_id"]
    loop = make(root, resume_from="latest", every_steps=1, keep_last=1)
    with pytest.warns(RuntimeWarning, match=r"1 checkpoint\(s\) that are not this run's \(step-00000000;"):
        loop.fit(max_steps=4)
    assert tree(root) == ["latest", "step-00000000", "step-00000004"]
    assert read_manifest(root / "step-00000004")["run_id"] == run_id  # inherited
    assert read_manifest(root / "step-00000000")["run_id"] != run_id


# -- 3. pickles of register_for_checkpointing objects ---------------------------------


class RunsCode:
    """Unpickling it calls open(path, "w"): stands for any code a crafted file runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@dataclass
class Point:
    x: int = 0


class Registered:
    def __init__(self, payload=None):
        self.payload = payload
        self.loaded = None

    def state_dict(self):
        return {"payload": self.payload}

    def load_state_dict(self, state):
        self.loaded = state


def registered_loop(root, payload, **checkpoint):
    reset_accelerate()
    loop = tiny_loop([Checkpoint(dir=root, signals=None, **checkpoint)])
    obj = Registered(payload)
    loop.accelerator.register_for_checkpointing(obj)
    return loop, obj


def test_a_registered_objects_pickle_never_runs_unless_trusted_by_name(tmp_path):
    marker = tmp_path / "code-ran"
    loop, _ = registered_loop(tmp_path / "ck", RunsCode(marker))
    loop.fit(max_steps=2)
    assert not marker.exists()  # writing it runs nothing
    loop, obj = registered_loop(tmp_path / "ck", None)
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0.pkl, the state of an object registered "
                                              r"with accelerator.register_for_checkpointing, is a pickle"
                                              r"(.|\n)*trust_pickles=\['custom_checkpoint_0.pkl'\]"):
        loop.load_checkpoint("latest")
    assert not marker.exists() and obj.loaded is None and loop.state.global_step == 0


def test_trusted_by_name_a_pickle_loads_and_plain_data_needs_no_trust(tmp_path):
    loop, _ = registered_loop(tmp_path / "ck", Point(3))
    loop.fit(max_steps=2)
    loop, obj = registered_loop(tmp_path / "ck", None, trust_pickles=["custom_checkpoint_0.pkl"])
    loop.load_checkpoint("latest")
    assert obj.loaded == {"payload": Point(3)}

    loop, _ = registered_loop(tmp_path / "data", {"w": torch.arange(3), "n": 2})
    loop.fit(max_steps=2)
    loop, obj = registered_loop(tmp_path / "data", None)
    loop.load_checkpoint("latest")  # tensors and plain data: read with weights_only=True
    assert obj.loaded["payload"]["n"] == 2 and torch.equal(obj.loaded["payload"]["w"], torch.arange(3))


def test_the_guide_says_what_is_true_of_pickles():
    readme = (ROOT / "docs" / "guide.md").read_text()
    assert "register_for_checkpointing" in readme and "trust_pickles" in readme


# -- 4. checksums -----------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_same_size_corruption_is_found_latest_falls_back_a_path_raises(tmp_path, rel):
    make(tmp_path, keep_last=None).fit(max_steps=4)
    flip_byte(tmp_path / "step-00000004" / rel)
    with pytest.warns(RuntimeWarning, match=rf"names 'step-00000004', which is not usable .*{rel}: it does "
                                            r"not match its checksum"):
        loop = make(tmp_path, resume_from="latest")
    assert loop.resumed_from.name == "step-00000002" and loop.state.global_step == 2
    with pytest.raises(CheckpointError, match=rf"step-00000004'.*from {rel}: it does not match its checksum"):
        make(tmp_path, resume_from=tmp_path / "step-00000004")


def test_an_edited_manifest_is_found(tmp_path):
    make(tmp_path).fit(max_steps=2)
    file = tmp_path / "step-00000002" / "hookloop.json"
    file.write_text(file.read_text().replace('"global_step": 2', '"global_step": 3'))
    with pytest.raises(CheckpointError, match="hookloop.json does not match its own checksum"):
        make(tmp_path, resume_from=tmp_path / "step-00000002")


# -- 5. run settings --------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "was", "now"), [
    (dict(batch_size=4), "batch_size=8", "batch_size=4"),
    (dict(n=56), "dataset_length=64", "dataset_length=56"),
    (dict(accum=2), "gradient_accumulation_steps=1", "gradient_accumulation_steps=2"),
])
def test_resuming_with_other_run_settings_is_refused_naming_the_setting(tmp_path, kwargs, was, now):
    make(tmp_path).fit(max_steps=2)
    with pytest.raises(CheckpointError, match=rf"{was} \(this run has {now}: .*strict=False"):
        make(tmp_path, resume_from="latest", **kwargs)
    loop = make(tmp_path, **kwargs)
    with pytest.warns(RuntimeWarning, match=rf"{was} \(this run has {now}.*Resuming anyway"):
        loop.load_checkpoint("latest", strict=False)
    assert loop.state.global_step == 2


# -- 6. all or nothing --------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["scheduler.bin", "optimizer.bin"])
def test_a_load_that_fails_changes_nothing_and_names_the_file(tmp_path, rel):
    make(tmp_path).fit(max_steps=2)
    rewrite(tmp_path / "step-00000002", rel, b"PK\x03\x04 not really a zip file")
    loop = make(tmp_path)
    before = params(loop)
    with pytest.raises(CheckpointError, match=rf"cannot read the \w+ state of network 'model' from {rel}"):
        loop.load_checkpoint(tmp_path / "step-00000002")
    assert differing(params(loop), before) == []  # the weights were read, never applied
    assert loop.networks["model"].optimizer.state_dict()["state"] == {}
    assert loop.state.global_step == 0 and loop.resumed_from is None


def test_latest_falls_back_to_the_newest_loadable_checkpoint(tmp_path):
    make(tmp_path, keep_last=None).fit(max_steps=4)
    rewrite(tmp_path / "step-00000004", "scheduler.bin", b"\x80\x04K\x01.")  # a pickle of 1: not a dict
    rewrite(tmp_path / "step-00000004", "optimizer.bin", b"garbage")
    with pytest.warns(RuntimeWarning, match=r"'step-00000004', which is not usable .*optimizer.bin"):
        loop = make(tmp_path, resume_from="latest")
    assert loop.resumed_from.name == "step-00000002"


# -- 7. signals -----------------------------------------------------------------------------


class SendSignal:
    name = "send_signal"

    def __init__(self, at, signum=signal.SIGTERM):
        self.at, self.signum = at, signum

    @hookimpl
    def before_backward(self, loop):
        if loop.state.global_step + 1 == self.at:
            os.kill(os.getpid(), self.signum)


def two_checkpoints(tmp_path, **kwargs):
    a = Checkpoint(dir=tmp_path / "a", **kwargs)
    b = Checkpoint(dir=tmp_path / "b", **kwargs)
    b.name = "checkpoint-b"
    return a, b


def test_two_checkpoint_plugins_both_save_on_sigterm_and_give_the_handlers_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    a, b = two_checkpoints(tmp_path)
    loop = tiny_loop([SendSignal(at=3), a, b])
    with pytest.raises(Preempted) as info:
        loop.fit(epochs=2)
    assert info.value.code == PREEMPTED_EXIT_CODE and info.value.global_step == 3
    for root in (tmp_path / "a", tmp_path / "b"):
        assert (root / "latest").read_text().strip() == "step-00000003"
        assert read_manifest(root / "step-00000003")["reason"] == "preempted"
    loop.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_the_handlers_stay_after_a_fit_and_come_back_when_the_loop_is_closed(tmp_path):
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    loop = tiny_loop(list(two_checkpoints(tmp_path)))
    loop.fit(max_steps=2)
    # a preemption during an evaluate() or predict() after fit still ends with 75
    assert signal.getsignal(signal.SIGTERM) is not before[0]
    loop.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_handlers_come_back_even_when_another_plugins_cleanup_raises(tmp_path):
    class Boom:
        @hookimpl
        def after_step(self):
            raise RuntimeError("boom")

    class BadCleanup:
        @hookimpl
        def on_exception(self):
            raise OSError("cleanup failed")

    before = signal.getsignal(signal.SIGTERM)
    loop = tiny_loop([Boom(), BadCleanup(), Checkpoint(dir=tmp_path)])
    with pytest.raises(Exception, match="boom"):
        loop.fit(max_steps=2)
    loop.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_during_the_final_save_ends_with_status_75(tmp_path, monkeypatch):
    handed_on = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: handed_on.append(signum))
    try:
        publish = writer.publish

        def publish_and_get_signalled(tmp, final, **options):
            if final.name == "step-00000003":
                os.kill(os.getpid(), signal.SIGTERM)
            return publish(tmp, final, **options)

        monkeypatch.setattr(writer, "publish", publish_and_get_signalled)
        loop = tiny_loop([Checkpoint(dir=tmp_path, every_steps=2)])
        with pytest.raises(Preempted) as info:
            loop.fit(max_steps=3)
        assert info.value.code == PREEMPTED_EXIT_CODE
        assert info.value.checkpoint == tmp_path / "step-00000003"
        assert (tmp_path / "latest").read_text().strip() == "step-00000003"
        assert handed_on == []  # the run's stop, not the previous handler's business
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_latest_finds_the_checkpoint_plugin_by_type(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where ./checkpoints, the default, would be

    def renamed():
        plugin = Checkpoint(dir=tmp_path / "mine", every_steps=2, signals=None)
        plugin.name = "my-checkpoints"
        return plugin

    reset_accelerate()
    tiny_loop([renamed()]).fit(max_steps=4)
    reset_accelerate()
    loop = tiny_loop([renamed()], resume_from="latest")
    assert loop.resumed_from == tmp_path / "mine" / "step-00000004"


# -- 8. the smaller ones --------------------------------------------------------------------


@pytest.mark.parametrize("content", ["absolute", "../outside/step-00000002", "..", "."])
def test_latest_is_never_followed_out_of_its_root(tmp_path, content):
    root = tmp_path / "run"
    make(root).fit(max_steps=2)
    shutil.copytree(root, tmp_path / "outside")  # a loadable checkpoint outside the root
    if content == "absolute":
        content = str(tmp_path / "outside" / "step-00000002")
    (root / "latest").write_text(content + "\n")
    with pytest.raises(CheckpointError, match=r"latest' holds .*refusing to follow it out of the checkpoint root"):
        make(root, resume_from="latest")


def test_a_latest_that_is_not_utf8_is_a_checkpoint_error(tmp_path):
    make(tmp_path).fit(max_steps=2)
    (tmp_path / "latest").write_bytes(b"\xff\xfestep-00000002\n")
    with pytest.raises(CheckpointError, match=r"latest' is not UTF-8 text"):
        make(tmp_path, resume_from="latest")


def test_a_garbled_hookloop_safetensors_is_a_checkpoint_error_naming_it(tmp_path):
    make(tmp_path).fit(max_steps=2)
    ckpt = tmp_path / "step-00000002"
    size = (ckpt / "hookloop.safetensors").stat().st_size
    rewrite(ckpt, "hookloop.safetensors", b"\xff" * size)
    with pytest.raises(CheckpointError, match=r"cannot read the plugin states from hookloop.safetensors: "
                                              r"it is corrupt"):
        make(tmp_path, resume_from=ckpt)


def test_a_garbled_rank_file_fails_at_load_not_during_fit(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save as save_bytes

    make(tmp_path).fit(max_steps=2)  # mid-epoch: the epoch's random state is used on resume
    ckpt = tmp_path / "step-00000002"
    with safe_open(str(ckpt / "hookloop-rank0.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["epoch.python"] = torch.full_like(tensors["epoch.python"], -1)  # not a Mersenne Twister state
    rewrite(ckpt, "hookloop-rank0.safetensors", save_bytes(tensors, metadata=meta))
    with pytest.raises(CheckpointError, match=r"cannot read the data position of process 0 from "
                                              r"hookloop-rank0.safetensors"):
        make(tmp_path, resume_from="latest").fit(epochs=1)


def test_an_optimizer_file_with_foreign_objects_never_suggests_weights_only_false(tmp_path):
    import io

    make(tmp_path).fit(max_steps=2)
    ckpt = tmp_path / "step-00000002"
    buffer = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "x": RunsCode(tmp_path / "code-ran")}, buffer)
    rewrite(ckpt, "optimizer.bin", buffer.getvalue())
    with pytest.raises(CheckpointError) as info:
        make(tmp_path, resume_from=ckpt)
    shown = "".join(traceback.format_exception(info.value))
    assert "optimizer.bin" in str(info.value)
    assert re.search(r"it refers to _?io\.open", str(info.value))  # (Python 3.13 pickles it as _io.open)
    assert "weights_only=False" not in shown and "`weights_only` set to `False`" not in shown
    assert not (tmp_path / "code-ran").exists()


def test_an_adam_checkpoint_into_sgd_names_the_network_and_both_classes_at_load(tmp_path):
    build(tmp_path, every_steps=2).fit(max_steps=2)
    with pytest.raises(CheckpointError, match=r"network 'model': optimizer.bin holds the state of a Adam "
                                              r"optimizer .*this network's optimizer is a SGD"):
        build(tmp_path, optimizer="sgd", resume_from="latest")


def test_a_full_disk_says_no_space_left_on_the_directory(tmp_path, monkeypatch):
    loop = make(tmp_path / "ck", keep_last=None)
    loop.fit(max_steps=2)
    real_usage = shutil.disk_usage

    def torch_save_on_a_full_disk(*args, **kwargs):  # what torch's zip writer reports
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4374")

    monkeypatch.setattr(torch, "save", torch_save_on_a_full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))
    with pytest.raises(Exception) as info:
        loop.fit(max_steps=4)
    assert f"no space left on {tmp_path / 'ck'} (0 bytes free)" in str(original(info.value))
    assert tree(tmp_path / "ck") == ["latest", "step-00000002"]


def test_enospc_from_a_write_says_no_space_left_on_the_directory(tmp_path, monkeypatch):
    def write_on_a_full_disk(file, loop):
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(codec, "write_rank_file", write_on_a_full_disk)
    loop = make(tmp_path)
    with pytest.raises(Exception) as info:
        loop.fit(max_steps=2)
    assert f"no space left on {tmp_path}" in str(original(info.value))
    assert tree(tmp_path) == []


def test_parameters_in_no_param_group_are_named_in_a_warning():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with pytest.warns(RuntimeWarning, match=r"network 'model': 2 parameter\(s\) require grad but are in "
                                            r"no param group of its optimizer \(Adam\), so they never "
                                            r"train: 2.weight, 2.bias"):
        Loop(model=model, optimizer=torch.optim.Adam(model[0].parameters()), block=["progress"])


class Unfreeze:
    """Backbone fine-tuning: after update ``at`` the first layer trains too,
    in a param group of its own."""

    name = "unfreeze"

    def __init__(self, at):
        self.at = at
        self.done = False

    @hookimpl
    def after_step(self, loop):
        if not self.done and loop.state.global_step >= self.at:
            self.unfreeze(loop)

    def unfreeze(self, loop):
        network = loop.networks["model"]
        layer = network.unwrapped[0]
        layer.requires_grad_(True)
        network.optimizer.add_param_group({"params": list(layer.parameters()), "lr": 1e-3})
        self.done = True

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state):
        self.done = state["done"]


class UnfreezeEarly(Unfreeze):
    def load_state_dict_early(self, state, loop):
        if state["done"]:
            self.unfreeze(loop)  # the param group exists before the optimizer state is loaded


def test_a_plugin_that_adds_a_param_group_restores_early_or_gets_a_clear_error(tmp_path):
    def loop(plugin, root=tmp_path, **kwargs):  # no scheduler: it would not know the new group
        return build(root, plugin, frozen_first=True, scheduler=False, every_steps=4, **kwargs)

    reference = loop(UnfreezeEarly(at=2), root=None)
    reference.fit(max_steps=6)
    loop(UnfreezeEarly(at=2)).fit(max_steps=4)

    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'step-00000004'}.*network 'model': "
                                              r"optimizer.bin holds 2 param group\(s\) of \[2, 2\] "
                                              r"parameters; this network's Adam has 1 of \[2\].*"
                                              r"load_state_dict_early"):
        loop(Unfreeze(at=2), resume_from="latest")

    resumed = loop(UnfreezeEarly(at=2), resume_from="latest")
    assert len(resumed.networks["model"].optimizer.param_groups) == 2
    resumed.fit(max_steps=6)
    assert differing(params(resumed), params(reference)) == []


# -- hookloop 0.1 checkpoints still load ------------------------------------------------------


def test_a_version_1_checkpoint_is_refused_naming_the_hookloop_that_wrote_it(tmp_path):
    # 0.5 reads the checkpoints of 0.3 and 0.4 (tests/checkpointing/test_guarantees_0_5.py); 0.1's
    # format (version 1) gets a clear error, nothing loaded
    make(tmp_path, keep_last=None).fit(max_steps=4)
    for ckpt in tmp_path.glob("step-*"):  # what hookloop 0.1 wrote: no checksums, no run id
        file = ckpt / "hookloop.json"
        doc = json.loads(file.read_text())
        for key in ("crc32", "run_id", "root", "settings", "classes", "checks", "manifest_crc32"):
            del doc[key]
        doc["version"], doc["versions"]["hookloop"] = 1, "0.1.0"
        doc["loop"].pop("micro_step")
        file.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"step-00000004' was written by hookloop 0\.1\.0 \(format version "
                                              r"1\), which this hookloop does not read: checkpoints of hookloop 0\.3"):
        make(tmp_path, resume_from=tmp_path / "step-00000004")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*written by hookloop 0\.1\.0"):
        make(tmp_path, resume_from="latest")


@pytest.mark.slow
def test_a_process_sent_sigterm_during_its_final_save_exits_75(tmp_path):
    import runner

    args = ("--strategy", "supervised", "--accum", "2", "--epochs", "3", "--every-steps", "3")
    out = tmp_path / "run"
    out.mkdir()
    # 3 epochs of 4 updates: the last save is step-12-epoch-end; held before its rename
    process = runner.plain_python(out, *args, "--pause", "savesignal:publish:12")
    runner.wait_for_markers(process, out / "paused-0")
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert process.returncode == PREEMPTED_EXIT_CODE, output[-3000:]  # not -15
    assert "SIGTERM received" in output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000012-epoch-end"
    read_manifest(out / "checkpoints" / "step-00000012-epoch-end")
    runner.Run(out, *args, name="requeued").finish()  # the requeued job has nothing left to do
    assert json.loads((out / "run.json").read_text())["started_at"] == 12
