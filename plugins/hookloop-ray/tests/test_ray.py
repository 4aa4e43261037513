"""hookloop-ray on a Ray cluster of this machine (``ray.init(num_cpus=2)``,
``TorchTrainer`` with two CPU workers, gloo): a run whose rank-1 worker dies
once after the first reported checkpoint is restarted by Ray
(``FailureConfig(max_failures=1)``), resumes from the checkpoint Ray gives
back and ends bit for bit where an uninterrupted run ends; ``Result.metrics``
has the evaluation's loss, ``Result.checkpoint`` is the last checkpoint.
Each run is a fresh ``python ray_run.py`` (Ray pickles its ``train_func`` by
value from a script's ``__main__``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def run(out: Path, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(HERE / "ray_run.py"), str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def lines(file):
    return [json.loads(line) for line in file.read_text().splitlines()]


@pytest.mark.slow
def test_a_worker_that_dies_is_restarted_by_ray_and_resumes_bit_for_bit(tmp_path):
    reference = run(tmp_path / "reference")
    assert [s["global_step"] for s in lines(tmp_path / "reference" / "starts.jsonl")] == [0]
    result = run(tmp_path / "run", "--fail-once")
    starts = lines(tmp_path / "run" / "starts.jsonl")
    # Ray's process group taken as it is: two processes of a multi-CPU run, twice
    assert [(s["num_processes"], s["distributed_type"]) for s in starts] == [(2, "MULTI_CPU")] * 2
    died_at = int((tmp_path / "run" / "failed").read_text())
    assert starts[0]["global_step"] == 0 and starts[1]["global_step"] == 3 < died_at  # Ray's checkpoint
    assert "checkpoint_" in starts[1]["resumed_from"]  # Ray's copy, not hookloop's folder
    a = torch.load(tmp_path / "reference" / "params.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "params.pt", weights_only=True)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    for r in (reference, result):
        assert r["error"] is None
        assert r["metrics"]["global_step"] == 12 and "eval_loss" in r["metrics"]
        assert (Path(r["checkpoint"]) / "hookloop.json").is_file()
        doc = json.loads((Path(r["checkpoint"]) / "hookloop.json").read_text())
        assert doc["loop"]["global_step"] == 12  # the last checkpoint: the fit's end
    assert result["metrics"]["eval_loss"] == reference["metrics"]["eval_loss"]
