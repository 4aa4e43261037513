"""loop.log takes one number per key on_step, and says so at the call;
images go to the trackers that take them through loop.log_images, read back
here from TensorBoard's own event files."""

import glob
import io
import json

import numpy as np
import pytest
import torch
from accelerate import Accelerator

from hookloop import hookimpl
from hookloop.trackers import JSONLinesTracker

pytest.importorskip("tensorboard")


def tensorboard_images(root):
    """``{tag: [(step, pixels as a uint8 array (H, W, C))]}`` from every event file under ``root``."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = {}
    for events in glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True):
        accumulator = EventAccumulator(events, size_guidance={"images": 0, "scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["images"]:
            for event in accumulator.Images(tag):
                pixels = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
                images.setdefault(tag, []).append((event.step, pixels))
    return images


def tensorboard_scalars(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True):
        accumulator = EventAccumulator(events, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars[tag] = [e.step for e in accumulator.Scalars(tag)]
    return scalars


@pytest.mark.parametrize("tracked", [False, True], ids=["no-tracker", "tensorboard"])
def test_a_value_of_several_numbers_logged_on_step_is_refused_at_the_call(tiny_loop, tmp_path, tracked):
    logged = []

    class LogsAnImage:
        @hookimpl
        def after_step(self, loop):
            # on_epoch alone reduces every value of a tensor: still fine
            loop.log({"per_example": torch.tensor([1.0, 3.0])}, on_step=False, on_epoch=True)
            logged.append(loop.state.global_step)
            loop.log({"ok": 1.0, "my/image": torch.rand(3, 8, 8)})

    accelerator = Accelerator(log_with="tensorboard", project_dir=tmp_path) if tracked else None
    loop = tiny_loop([LogsAnImage()], accelerator=accelerator)
    with pytest.raises(ValueError) as raised:
        loop.fit(epochs=1)
    message = str(raised.value)
    assert logged == [1]  # at the first call, not at an epoch end
    assert "loop.log: 'my/image' (plugin 'LogsAnImage') is a tensor of shape [3, 8, 8] (192 values)" in message
    assert "on_step=False, on_epoch=True" in message and "loop.log_images({'my/image': image})" in message
    assert not isinstance(raised.value, RuntimeError)  # not torch's "cannot be converted to Scalar"


def test_a_numpy_array_is_refused_and_one_element_values_pass(tiny_loop):
    class Logs:
        @hookimpl
        def after_step(self, loop):
            loop.log({"a": torch.tensor(1.0), "b": torch.tensor([2.0]), "c": np.float32(3.0),
                      "d": np.array([4.0])})
            loop.log({"hist": np.zeros((2, 5))})

    with pytest.raises(ValueError, match=r"loop.log: 'hist' \(plugin 'Logs'\) is a ndarray of shape \[2, 5\] \(10 values\)"):
        tiny_loop([Logs()]).fit(max_steps=1)


def test_images_reach_tensorboard_at_the_step_loop_log_uses(tiny_loop, tmp_path, capsys):
    torch.manual_seed(1)
    rgb = (torch.rand(3, 5, 6) * 255).to(torch.uint8)  # (C, H, W) uint8: pixels as given
    batch = (torch.rand(2, 3, 4, 4) * 255).to(torch.uint8)  # (N, C, H, W): TensorBoard's grid of 2
    grey = torch.rand(4, 7)  # (H, W) floats in [0, 1]
    steps = []

    class Pictures:
        @hookimpl
        def after_step(self, loop):
            if loop.state.global_step % 4 == 0:
                steps.append(loop.state.global_step)
                loop.log({"seen": 1.0})
                loop.log_images({"rgb": rgb, "batch": batch, "grey": grey})

    accelerator = Accelerator(log_with=["tensorboard", JSONLinesTracker("run", tmp_path)],
                              project_dir=tmp_path / "tb")
    tiny_loop([Pictures()], accelerator=accelerator).fit(epochs=1)
    images = tensorboard_images(tmp_path / "tb")
    assert steps == [4, 8] and sorted(images) == ["batch", "grey", "rgb"]
    assert [s for s, _ in images["rgb"]] == tensorboard_scalars(tmp_path / "tb")["seen"] == [4, 8]
    for _, pixels in images["rgb"]:
        assert np.array_equal(pixels, rgb.permute(1, 2, 0).numpy())
    for _, pixels in images["batch"]:  # side by side
        assert np.array_equal(pixels, torch.cat(list(batch), dim=2).permute(1, 2, 0).numpy())
    expected_grey = (grey * 255).clamp(0, 255).to(torch.uint8).numpy()  # TensorBoard's own scaling
    for _, pixels in images["grey"]:
        assert np.array_equal(pixels[..., 0], expected_grey) and np.array_equal(pixels[..., 1], expected_grey)
    # the JSON lines tracker takes no images: said once; it got the scalars only
    err = capsys.readouterr().err
    assert err.count("no images") == 1 and "tracker 'jsonl' takes no images" in err
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "seen" in r] == [4, 8] and not any("rgb" in r for r in rows)


def test_log_images_checks_the_shape_on_every_call_and_names_the_key(tiny_loop):
    loop = tiny_loop()
    with pytest.raises(ValueError, match=r"'hwc' is a tensor of shape \[8, 8, 3\] .*permute\(2, 0, 1\)"):
        loop.log_images({"hwc": torch.rand(8, 8, 3)})
    with pytest.raises(ValueError, match=r"'ints' is a tensor of shape \[3, 4, 4\] \(torch.int64\): pixels are floats"):
        loop.log_images({"ints": torch.zeros(3, 4, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"'flat' is a tensor of shape \[16\]"):
        loop.log_images({"flat": torch.rand(16)})


def test_the_sample_grid_can_send_its_grid_to_the_trackers(tiny_gan_loop, tmp_path):
    pytest.importorskip("PIL")
    from hookloop.plugins import SampleGrid

    grid = SampleGrid(tmp_path / "png", n=4, image_shape=(1, 1, 2), value_range=(-3.0, 3.0), scale=1,
                      to_trackers=True)
    loop = tiny_gan_loop([grid], accelerator=Accelerator(log_with="tensorboard", project_dir=tmp_path / "tb"))
    loop.fit(epochs=2)
    images = tensorboard_images(tmp_path / "tb")
    assert [s for s, _ in images["samples"]] == [0, 4, 8]  # before training, each epoch's end
    from PIL import Image

    written = [np.asarray(Image.open(p).convert("RGB")) for p in grid.paths]
    assert all(np.array_equal(pixels, png) for (_, pixels), png in zip(images["samples"], written))
