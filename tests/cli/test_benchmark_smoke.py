"""benchmarks/overhead.py keeps working: a quick run (a few steps of every
workload and variant, one repeat) prints the table, writes it with --out, and
every variant with a hand-written twin ends with bitwise-equal parameters.
The timings of a quick run mean nothing and are not checked."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paths import ROOT

pytestmark = pytest.mark.slow  # every workload and variant in fresh processes, ~1 min

BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import overhead  # noqa: E402


def test_quick_run_prints_the_table_and_every_twin_is_bitwise_equal(tmp_path):
    out = tmp_path / "table.md"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "overhead.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    assert result.stdout.strip() == text.strip()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in overhead.LABELS.values():
            rows.setdefault(cells[0], []).append(cells)
    for workload, variants in overhead.QUICK_WORKLOADS.items():
        assert f"**{workload}**" in text
        for variant in variants:
            cells = rows[overhead.LABELS[variant]].pop(0)  # tables come in workload order
            assert float(cells[1]) > 0, cells
            if variant != "hand":
                assert cells[-1] == "yes (1/1)", f"{workload}/{variant}: params differ: {cells}"
    assert "no-op plugins:" in text and "QUICK RUN" in text
