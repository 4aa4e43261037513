"""Sharded networks in hookloop checkpoints (checkpointing/formats.py).

Two processes on a CPU (tests/scripts/sharded.py): Accelerate's FSDP, forced
(Accelerate never runs FSDP on a CPU), and a model the user sharded with
``fully_shard`` under ``Loop(prepare=False)``. In this process: DeepSpeed's
layout through a fake engine (deepspeed is not installed), and DCP metadata
that is not DCP's.
"""

import json
import os
import pickle
import signal
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sharded.py"
PATIENCE_S = 150


def launch(out: Path, *args):
    """sharded.py in two processes, as ``accelerate launch --multi_gpu
    --num_processes 2`` runs it (``Accelerator(cpu=True)``): runner.launch_two."""
    import runner

    return runner.launch_two(out, *args, script=SCRIPT)


def wait(process) -> str:
    try:
        return process.communicate(timeout=PATIENCE_S)[0]
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"the run hung:\n{process.communicate()[0][-4000:]}") from None


def finish(out: Path, *args) -> dict:
    output = wait(launch(out, *args))
    assert (out / "run.json").exists(), output[-4000:]
    return json.loads((out / "run.json").read_text())


def kill_when_paused(out: Path, *args) -> None:
    """Run until both ranks hold at ``--pause``, then SIGKILL both ranks (as
    the kernel's OOM killer or a lost node would)."""
    import runner

    process = launch(out, *args)
    markers = [out / "paused-0", out / "paused-1"]
    runner.wait_for_markers(process, *markers)
    for m in markers:
        os.kill(json.loads(m.read_text())["pid"], signal.SIGKILL)
    process.communicate(timeout=PATIENCE_S)
    assert process.returncode != 0


def params(out: Path) -> dict:
    return torch.load(out / "params.pt", weights_only=True)


def differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "hookloop.json").read_text())


@pytest.fixture(scope="module")
def forced_fsdp2_reference(tmp_path_factory):
    """The uninterrupted run of FSDP2 through Accelerate, *forced*: on a CPU
    Accelerate turns an ``fsdp_plugin`` into plain DDP, so sharded.py's
    ``force_fsdp`` sets ``distributed_type = FSDP`` (in both of Accelerate's
    process states) and the plugin before ``Loop`` prepares the model; torch's
    ``fully_shard`` then shards it over a CPU gloo mesh, and ``save_state``
    takes its FSDP branch as on GPUs. Two epochs, 8 updates."""
    out = tmp_path_factory.mktemp("fsdp2-reference")
    run = finish(out, "--mode", "accelerate")
    return out, run


@pytest.mark.slow
def test_forced_fsdp2_trains_clips_evaluates_predicts_and_resumes_bitwise(forced_fsdp2_reference, tmp_path):
    ref, run = forced_fsdp2_reference
    assert run["distributed_type"] == "DistributedType.FSDP" and run["num_processes"] == 2
    assert run["model_class"] == "FSDPSequential"  # prepared by Accelerate's fully_shard
    # GradClip: accelerator.clip_grad_norm_, a DTensor norm (Accelerate 1.16's DTensor-aware
    # clipping returns it whole: a plain tensor)
    assert run["norms"] in (["DTensor"] * 3, ["Tensor"] * 3)
    assert run["predict_shape"] == [24, 3] and run["predict_max_error"] < 1e-5
    assert abs(run["eval"]["eval_loss"] - run["eval_reference_loss"]) < 1e-5

    # killed in the first epoch's last batch (update 4): the last checkpoint is update 3's, mid-epoch
    kill_when_paused(tmp_path, "--mode", "accelerate", "--pause", "step:4")
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    doc = manifest(checkpoint)
    assert doc["sharding"]["accelerate"] == {"format": "fsdp", "fsdp_version": 2,
                                             "state_dict_type": "SHARDED_STATE_DICT"}
    shards = {f"{d}/__{r}_0.distcp" for d in ("pytorch_model_fsdp_0", "optimizer_0") for r in (0, 1)}
    assert shards | {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(doc["files"])
    assert doc["sharding"]["shards"] == {
        str(r): [f"optimizer_0/__{r}_0.distcp", f"pytorch_model_fsdp_0/__{r}_0.distcp"] for r in (0, 1)}
    on_disk = {p.relative_to(checkpoint).as_posix(): p.stat().st_size
               for p in checkpoint.rglob("*") if p.is_file() and p.name != "hookloop.json"}
    assert doc["files"] == on_disk and set(doc["crc32"]) == set(on_disk)
    assert doc["networks"]["model"] == {"model": "pytorch_model_fsdp_0", "optimizer": "optimizer_0",
                                        "scheduler": "scheduler.bin"}

    resumed = finish(tmp_path, "--mode", "accelerate")
    assert resumed["started_at"] == 3 and resumed["global_step"] == 8
    assert differ(params(tmp_path), params(ref)) == []


@pytest.mark.slow
def test_forced_fsdp2_full_state_dict_resumes_bitwise(forced_fsdp2_reference, tmp_path):
    ref, _ = forced_fsdp2_reference
    args = ("--mode", "accelerate", "--state-dict", "FULL_STATE_DICT")
    kill_when_paused(tmp_path, *args, "--pause", "step:4")
    doc = manifest(tmp_path / "checkpoints" / "step-00000003")
    assert doc["sharding"]["accelerate"]["state_dict_type"] == "FULL_STATE_DICT"
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(doc["files"])  # rank 0's, whole
    assert doc["networks"]["model"]["model"] == "pytorch_model_fsdp.bin"
    resumed = finish(tmp_path, *args)
    assert resumed["started_at"] == 3
    assert differ(params(tmp_path), params(ref)) == []


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known gap: forced FSDP1 on a CPU resumes 2e-3 away after one "
                   "update (FSDP2, the supported path, is bitwise); see docs/distributed.md")
def test_forced_fsdp1_sharded_resumes_bitwise(tmp_path):
    args = ("--mode", "accelerate", "--fsdp-version", "1", "--epochs", "1")
    ref = tmp_path / "reference"
    ref.mkdir()
    assert finish(ref, *args)["model_class"] == "FullyShardedDataParallel"
    out = tmp_path / "run"
    out.mkdir()
    kill_when_paused(out, *args, "--pause", "step:4")
    doc = manifest(out / "checkpoints" / "step-00000003")
    assert doc["sharding"]["accelerate"]["fsdp_version"] == 1
    assert {"pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/__1_0.distcp"} <= set(doc["files"])
    assert finish(out, *args)["started_at"] == 3
    assert differ(params(out), params(ref)) == []


@pytest.fixture(scope="module")
def fully_shard_runs(tmp_path_factory):
    """``fully_shard`` on the user's model, ``Loop(prepare=False)``, the
    user's optimizer over the sharded parameters and a DistributedSampler:
    the uninterrupted run (16 updates), and one whose every rank is
    killed at update 5 (checkpoint of update 4), then resumed."""
    args = ("--mode", "fully_shard", "--every-steps", "2")
    ref = tmp_path_factory.mktemp("fully-shard-reference")
    reference = finish(ref, *args)
    out = tmp_path_factory.mktemp("fully-shard-run")
    kill_when_paused(out, *args, "--pause", "step:5")
    latest = (out / "checkpoints" / "latest").read_text().strip()
    killed = manifest(out / "checkpoints" / latest)
    resumed = finish(out, *args)
    return {"ref": ref, "out": out, "reference": reference, "latest": latest, "killed": killed,
            "resumed": resumed, "args": args}


@pytest.mark.slow
def test_fully_shard_killed_at_update_5_resumes_bitwise(fully_shard_runs):
    runs = fully_shard_runs
    assert runs["reference"]["distributed_type"] == "DistributedType.MULTI_CPU"  # nothing prepared
    assert runs["reference"]["model_class"] == "FSDPSequential"
    assert runs["latest"] == "step-00000004"
    doc = runs["killed"]
    assert doc["sharding"]["networks"] == {"model": "dcp"}
    assert doc["sharding"]["shards"] == {"0": ["dcp/model/__0_0.distcp"], "1": ["dcp/model/__1_0.distcp"]}
    for rel in ("dcp/model/.metadata", "dcp/model/__0_0.distcp", "dcp/model/__1_0.distcp",
                "dcp/model/scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"):
        assert doc["files"][rel] > 0 and rel in doc["crc32"], rel
    assert doc["networks"]["model"] == {"model": "dcp/model/model", "optimizer": "dcp/model/optimizer",
                                        "scheduler": "dcp/model/scheduler.bin"}
    assert runs["resumed"]["started_at"] == 4 and runs["resumed"]["global_step"] == 16
    assert differ(params(runs["out"]), params(runs["ref"])) == []


@pytest.mark.slow
def test_a_corrupted_shard_is_refused_naming_it(fully_shard_runs, tmp_path):
    """Rank 1 verifies the shard it wrote; every rank refuses the checkpoint."""
    import shutil

    source = fully_shard_runs["out"] / "checkpoints"
    shutil.copytree(source, tmp_path / "checkpoints")
    latest = tmp_path / "checkpoints" / (source / "latest").read_text().strip()
    for old in (tmp_path / "checkpoints").iterdir():  # only the corrupted one to resume from
        if old.is_dir() and old != latest:
            shutil.rmtree(old)
    shard = latest / "dcp" / "model" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    process = launch(tmp_path, *fully_shard_runs["args"], "--epochs", "3")
    output = wait(process)
    assert process.returncode != 0
    assert "from dcp/model/__1_0.distcp: it does not match its checksum" in output, output[-4000:]
    assert output.count("__1_0.distcp: it does not match its checksum") >= 2  # both ranks refuse
    assert sorted(p.name for p in tmp_path.glob("refused-*")) == ["refused-0", "refused-1"]  # (refusals.py)
    assert not (tmp_path / "run.json").exists()


# -- in this process ----------------------------------------------------------------------


class FakeEngine(torch.nn.Module):
    """What Accelerate calls on a DeepSpeed engine to save and load: the
    layout DeepSpeed's ``save_checkpoint(dir, tag)`` writes (ZeRO stage 1/2,
    one process)."""

    def __init__(self, module, optimizer):
        super().__init__()
        self.module, self.optimizer = module, optimizer
        self.loaded = []

    def forward(self, *args):
        return self.module(*args)

    def save_checkpoint(self, save_dir, tag):
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.module.state_dict()}, folder / "mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": self.optimizer.state_dict()},
                   folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (Path(save_dir) / "latest").write_text(tag)
        (Path(save_dir) / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")

    def load_checkpoint(self, load_dir, tag):
        folder = Path(load_dir) / tag
        self.module.load_state_dict(torch.load(folder / "mp_rank_00_model_states.pt")["module"])
        state = torch.load(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        self.loaded.append((load_dir, tag))


def _deepspeed_loop(monkeypatch, tmp_path):
    """A Loop trained a little, then made to look like a DeepSpeed one
    (forced: deepspeed is not installed, and Accelerate uses it only on GPUs)."""
    import accelerate.accelerator
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from torch.utils.data import DataLoader, TensorDataset

    from hookloop import Loop

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, train_data=data,
                accelerator=Accelerator(cpu=True), block=["progress", "checkpoint"])
    loop.fit(epochs=1)
    acc = loop.accelerator
    monkeypatch.setattr(accelerate.accelerator, "DeepSpeedSchedulerWrapper", type("Never", (), {}),
                        raising=False)
    acc.state.distributed_type = DistributedType.DEEPSPEED
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    engine = FakeEngine(loop.networks["model"].unwrapped, loop.networks["model"].optimizer.optimizer)
    acc._models[0] = loop.networks["model"].model = engine
    return loop, engine


def test_a_deepspeed_run_is_refused_with_a_clear_error_and_nothing_is_written(monkeypatch, tmp_path):
    # DeepSpeed's engine saves and loads its own checkpoints (accelerator.save_state): hookloop 0.5
    # no longer wraps them (0.4 did, tested against a fake engine only)
    from hookloop import checkpointing

    loop, engine = _deepspeed_loop(monkeypatch, tmp_path)
    with pytest.raises(checkpointing.CheckpointError, match=r"not written or read under DEEPSPEED: its engine "
                                                            r"saves and loads its own"):
        checkpointing.save(loop, tmp_path / "ckpt", reason="test")
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_dcp_metadata_that_is_not_dcps_is_refused_unread():
    from hookloop.checkpointing import CheckpointError, formats

    with pytest.raises(CheckpointError, match=r"cannot read dcp/model/\.metadata: .*refers to "
                                              r"(posix|os)\.system.*never unpickles"):
        formats.load_metadata(pickle.dumps(_Boom()), "dcp/model/.metadata", "checkpoint 'x'")


def test_dcp_metadata_of_a_real_save_reads_safely(tmp_path):
    """One process, a plain state dict through torch.distributed.checkpoint
    (no process group): the restricted unpickler reads DCP's own metadata."""
    import torch.distributed.checkpoint as dcp

    from hookloop.checkpointing import formats

    state = {"model": {"w": torch.randn(3, 2)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = formats.load_metadata((tmp_path / ".metadata").read_bytes(), ".metadata", "x")
    assert tuple(metadata.state_dict_metadata["model.w"].size) == (3, 2)
