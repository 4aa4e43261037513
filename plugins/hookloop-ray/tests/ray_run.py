"""The README's Ray Train program, run as written under ``ray.init(num_cpus=2)``
(``TorchTrainer`` with two CPU workers, gloo), for test_ray.py.

    python ray_run.py OUT [--fail]

The block is the README's (and docs/scaling.md's) Python block, written to
OUT/train.py and run there as ``__main__`` with OUT as the working
directory: it trains in OUT/run. ray_probe.py observes it (and with
``--fail`` kills a worker twice) as an installed plugin that autoloads: a
distribution on the workers' ``PYTHONPATH`` with a ``hookloop`` entry point,
the only plugin allowed to autoload (``HOOKLOOP_LOAD_PLUGINS``).
OUT/result.json: the block's ``result`` (``Result.metrics``, the checkpoint's
path, the error) and what it printed.
"""

import contextlib
import io
import json
import os
import re
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"


def readme_block() -> str:
    """The README's Python block (the one ``train.py``)."""
    (block,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return block


def install_probe(site: Path) -> None:
    """What ``pip install`` of a distribution declaring ``ray-probe =
    ray_probe:Probe`` leaves for importlib.metadata."""
    info = site / "hookloop_ray_probe-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hookloop-ray-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[hookloop]\nray-probe = ray_probe:Probe\n")


def main(argv):
    import ray

    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    install_probe(out / "site")
    # the workers inherit this environment: the probe on their path, the only plugin that autoloads
    os.environ["PYTHONPATH"] = os.pathsep.join([str(out / "site"), str(HERE), os.environ.get("PYTHONPATH", "")])
    os.environ.pop("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", None)
    os.environ.update(HOOKLOOP_LOAD_PLUGINS="ray-probe", RAY_PROBE_OUT=str(out),
                      RAY_PROBE_FAIL="1" if "--fail" in argv else "0")
    (out / "train.py").write_text(readme_block())
    os.chdir(out)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        namespace = runpy.run_path(str(out / "train.py"), run_name="__main__")
    sys.stdout.write(printed.getvalue())
    result = namespace["result"]
    (out / "result.json").write_text(json.dumps({
        "metrics": result.metrics, "checkpoint": result.checkpoint and result.checkpoint.path,
        "error": result.error and repr(result.error), "printed": printed.getvalue()}, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
