"""hookloop-ray on a Ray cluster of this machine (``ray.init(num_cpus=2)``,
``TorchTrainer`` with two CPU workers, gloo), running README.md's program
as written (docs/scaling.md has the same block): uninterrupted, and with its
rank-1 worker dying twice at once after a report (before Ray's controller
registers it: Ray gives back no checkpoint, or an older one). Ray restarts
the group (the block's ``FailureConfig(max_failures=3)``), which resumes
each time from the newest checkpoint published before the death and ends
bit for bit where the uninterrupted run ends; ``Result.metrics`` has the
evaluation's loss, ``Result.checkpoint`` is the last checkpoint.
Each run is a fresh ``python ray_run.py`` (Ray pickles ``train_func`` by
value from a script's ``__main__``); ray_probe.py, an installed plugin that
autoloads, records each start and kills the worker."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hookloop.checkpointing import read_manifest

HERE = Path(__file__).resolve().parent
SCALING = HERE.parents[2] / "docs" / "scaling.md"  # (in hookloop's repository)


def run(out: Path, *args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(HERE / "ray_run.py"), str(out), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def lines(file):
    return [json.loads(line) for line in file.read_text().splitlines()]


def test_the_readme_s_block_is_docs_scaling_md_s():
    import re

    from ray_run import readme_block

    if not SCALING.exists():
        pytest.skip("not in hookloop's repository")
    assert readme_block() in re.findall(r"```python\n(.*?)```", SCALING.read_text(), flags=re.S)


@pytest.mark.slow
def test_a_worker_that_dies_at_once_after_a_report_is_restarted_by_ray_and_resumes_bit_for_bit(tmp_path):
    reference = run(tmp_path / "reference")
    assert [s["global_step"] for s in lines(tmp_path / "reference" / "starts.jsonl")] == [0]
    result = run(tmp_path / "run", "--fail")
    starts = lines(tmp_path / "run" / "starts.jsonl")
    # Ray's process group taken as it is: two processes of a multi-CPU run, three times
    assert [(s["num_processes"], s["distributed_type"]) for s in starts] == [(2, "MULTI_CPU")] * 3
    failures = lines(tmp_path / "run" / "failures.jsonl")
    # 4 updates an epoch, checkpoints at the epoch ends (every_steps=500 never comes): the first
    # death right after the first report (update 4), the second two updates after the restarted
    # attempt's first report (the epoch end, update 8)
    assert [(f["global_step"], f["last_saved"]) for f in failures] == [
        (4, "step-00000004-epoch-end"), (10, "step-00000008-epoch-end")]
    assert starts[0]["global_step"] == 0 and starts[0]["resumed_from"] == "None"
    for start, failure in zip(starts[1:], failures, strict=True):
        # the newest checkpoint published before the death: the folder's (Ray never registered it)
        # or Ray's copy of the same one, never an older one nor a refusal to start
        newest = read_manifest(tmp_path / "run" / "run" / "checkpoints" / failure["last_saved"])["loop"]
        assert read_manifest(start["resumed_from"])["loop"] == newest
        assert start["global_step"] == newest["global_step"]
    a = torch.load(tmp_path / "reference" / "params.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "params.pt", weights_only=True)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    for r in (reference, result):
        assert r["error"] is None
        assert r["metrics"]["global_step"] == 12 and "eval_loss" in r["metrics"]
        assert (Path(r["checkpoint"]) / "hookloop.json").is_file()
        doc = json.loads((Path(r["checkpoint"]) / "hookloop.json").read_text())
        assert doc["loop"]["global_step"] == 12  # the last checkpoint: the fit's end
        # the block's last line: print(result.metrics["eval_loss"], result.checkpoint)
        assert any(line.startswith(f"{r['metrics']['eval_loss']} Checkpoint(") and r["checkpoint"] in line
                   for line in r["printed"].splitlines()), r["printed"][-2000:]
    assert result["metrics"]["eval_loss"] == reference["metrics"]["eval_loss"]
