"""What ``RayReport`` reports, in this process, with ``ray.train`` replaced by a
recorder (no Ray session): every published checkpoint with the metrics of its
position, an epoch end without a checkpoint with its metrics alone, never the
sanity check's one-batch evaluation."""

import types

import hookloop_ray
from hookloop.plugins import Checkpoint


def test_each_published_checkpoint_and_each_epoch_end_without_one_is_reported_once(tiny_loop, tmp_path,
                                                                                     monkeypatch):
    reports = []
    fake = types.SimpleNamespace(report=lambda metrics, checkpoint=None: reports.append((metrics, checkpoint)),
                                 Checkpoint=types.SimpleNamespace(from_directory=lambda path: path))
    monkeypatch.setattr(hookloop_ray, "_train", lambda: fake)
    report = hookloop_ray.RayReport()
    loop = tiny_loop([Checkpoint(dir=tmp_path, every_steps=3, every_epoch=False), report], eval_data=True)
    final = loop.fit(epochs=2)  # 8 updates an epoch; the fit's end is always saved
    got = [(m["global_step"], m["epoch"], c and c.rsplit("/", 1)[-1]) for m, c in reports]
    assert got == [(3, 0, "step-00000003"), (6, 0, "step-00000006"), (8, 1, None), (9, 1, "step-00000009"),
                   (12, 1, "step-00000012"), (15, 1, "step-00000015"), (16, 2, "step-00000016-epoch-end")]
    assert report.reports == len(reports)
    metrics = [m for m, _ in reports]
    assert "eval_loss" not in metrics[0] and "eval_loss" not in metrics[1]  # no evaluation yet (sanity: one batch)
    assert metrics[2]["eval_loss"] == metrics[5]["eval_loss"] != metrics[6]["eval_loss"] == final["eval_loss"]
