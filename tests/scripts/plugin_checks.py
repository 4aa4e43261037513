"""What tests/test_plugin_distributions.py runs inside a virtual environment
with (or without) the distributions of plugins/ installed.

    python plugin_checks.py runs OUT.json [--switched-on]
    python plugin_checks.py controls OUT.json
    python plugin_checks.py broken OUT.json

Results go to OUT.json, not stdout: an installed profiler prints its table
there at the end of every fit.
"""

import hashlib
import json
import os
import sys
import warnings

from hookloop import PluginLoadError
from hookloop.cli import plugin_rows
from hookloop.testing import reset_accelerate, tiny_gan_loop, tiny_loop


def digest(loop):
    """A hash of every parameter of every network, bit for bit."""
    h = hashlib.sha256()
    for name, network in sorted(loop.networks.items()):
        for p in network.unwrapped.parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def run(make, **fit):
    reset_accelerate()
    loop = make()
    metrics = loop.fit(**fit)
    return {"params": digest(loop), "metrics": metrics, "global_step": loop.state.global_step,
            "plugins": loop.plugins.names()}


def runs(switched_on):
    small = {"n": 32, "eval_data": True}  # 4 batches an epoch
    out = {
        "supervised": run(lambda: tiny_loop(**small), epochs=3),
        "gan": run(lambda: tiny_gan_loop(), max_steps=4),
    }
    if switched_on:
        out["ema"] = run(lambda: tiny_loop([("ema", {"decay": 0.5})], **small), epochs=3)
        # min_delta 10: epoch 1 cannot improve on epoch 0, so it is the last
        out["early-stopping"] = run(
            lambda: tiny_loop([("early-stopping", {"patience": 1, "min_delta": 10.0})], **small),
            epochs=3)
        out["wgan-gp"] = run(lambda: tiny_gan_loop(["wgan-gp"]), max_steps=4)
    return out


CONTROLS = {
    "default": {},
    "autoload off": {"HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD": "1"},
    "allow none": {"HOOKLOOP_LOAD_PLUGINS": ""},
    "allow profiler": {"HOOKLOOP_LOAD_PLUGINS": "profiler"},
    "allow ema": {"HOOKLOOP_LOAD_PLUGINS": "ema"},
    "block profiler": {"HOOKLOOP_BLOCK_PLUGINS": "profiler"},
}


def controls():
    out = {}
    for label, env in CONTROLS.items():
        for key in ("HOOKLOOP_DISABLE_PLUGIN_AUTOLOAD", "HOOKLOOP_LOAD_PLUGINS", "HOOKLOOP_BLOCK_PLUGINS"):
            os.environ.pop(key, None)
        os.environ.update(env)
        rows = {r["name"]: r for r in plugin_rows()}
        reset_accelerate()
        unnamed = tiny_loop().plugins.names()
        reset_accelerate()
        named = tiny_loop(["profiler"]).plugins.names()
        reset_accelerate()
        blocked_in_code = tiny_loop(block=["progress", "profiler"]).plugins.names()
        out[label] = {
            "status": {n: rows[n]["status"] for n in ("profiler", "ema")},
            "reason": {n: rows[n]["reason"] for n in ("profiler", "ema")},
            "unnamed": unnamed,
            "named": named,
            "blocked_in_code": blocked_in_code,
        }
    return out


def broken():
    rows = {r["name"]: r for r in plugin_rows()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unnamed = tiny_loop().plugins.names()
    reset_accelerate()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ema = tiny_loop(["ema"]).plugins.names()
    reset_accelerate()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tiny_loop(["broken"])
        error = None
    except PluginLoadError as exc:
        error = {"message": str(exc), "distribution": exc.distribution, "entry_point": exc.entry_point}
    return {
        "row": rows["broken"],
        "warnings": [str(w.message) for w in caught],
        "unnamed": unnamed,
        "ema": ema,
        "error": error,
    }


if __name__ == "__main__":
    what, path = sys.argv[1], sys.argv[2]
    result = {"runs": lambda: runs("--switched-on" in sys.argv), "controls": controls,
              "broken": broken}[what]()
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
