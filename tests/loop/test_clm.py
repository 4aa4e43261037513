"""A causal language model on two processes: ``run_clm_no_trainer.py``'s loop
and its hookloop port (tests/scripts/clm_two_processes.py), side by side."""

import json
import math
from pathlib import Path

import pytest

import runner

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "clm_two_processes.py"


@pytest.mark.slow
def test_a_causal_lm_trains_and_evaluates_on_two_processes_as_run_clm_no_trainer_does(tmp_path):
    process = runner.launch_two(tmp_path, script=SCRIPT)
    output = process.communicate(timeout=runner.PATIENCE_S)[0]
    assert (tmp_path / "clm.json").exists(), output[-4000:]
    run = json.loads((tmp_path / "clm.json").read_text())
    assert run["processes"] == 2
    assert run["equal"]  # the parameters, bit for bit, after 2 epochs with accumulation 2
    assert len(run["port"]) == len(run["script"]) == 2
    for script, port in zip(run["script"], run["port"]):
        # 9 examples: the last batch leaves one, on one rank; every example counted once
        assert len(port["values"]) == len(script["values"]) == 9
        assert port["values"] == script["values"]
        assert port["eval_loss"] == pytest.approx(script["eval_loss"], rel=1e-6)  # (float64 / float32 sums)
        assert port["perplexity"] == math.exp(port["eval_loss"])  # the port's own plugin wrote it
