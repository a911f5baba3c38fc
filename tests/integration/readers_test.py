"""Loom's files, read by the real readers: model and optimizer checkpoints with Python's
`safetensors`, metrics with TensorBoard's event reader, and the JSON lines with `json`."""
import glob
import os
import shutil
import sys

from common import SMALL, loom, metrics, require, workdir

require("safetensors", "tensorboard", "torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

exe = sys.argv[1]
work = workdir()
try:
    loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=readers",
         "--set", "trainer.max_steps=12", "--set", "trainer.eval_every=6")
    run = os.path.join(work, "readers")

    # safetensors: the model of the last step, the optimizer state, the best model.
    step = os.path.join(run, "checkpoints", "step_00000012")
    model = load_file(os.path.join(step, "model.safetensors"))
    assert "param.head.weight" in model, sorted(model)
    assert model["param.head.weight"].shape == (4, 32), model["param.head.weight"].shape
    assert all(t.dtype.is_floating_point for t in model.values())
    optimizer = load_file(os.path.join(step, "optimizer.safetensors"))
    assert "optimizer.exp_avg.head.weight" in optimizer, sorted(optimizer)
    assert "rng.cpu" in optimizer
    with safe_open(os.path.join(run, "checkpoints", "best_accuracy.safetensors"), "pt") as f:
        meta = f.metadata()
        assert meta["metric"] == "accuracy" and int(meta["step"]) in (6, 12), meta
        assert set(f.keys()) == set(model.keys())
    print(f"safetensors: {len(model)} model tensors, {len(optimizer)} optimizer tensors, best at step {meta['step']}")

    # TensorBoard: every scalar Loom wrote, at the steps it wrote them.
    events = glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))
    assert len(events) == 1, events
    acc = EventAccumulator(os.path.join(run, "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "memory/allocated_bytes", "memory/peak_bytes", "val/accuracy", "val/loss", "test/accuracy", "test/loss"):
        assert tag in tags, (tag, tags)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 13)), [e.step for e in loss]
    jsonl = [m for m in metrics(run) if "train/loss" in m]
    for event, line in zip(loss, jsonl):
        assert abs(event.value - line["train/loss"]) < 1e-5 * max(1.0, abs(line["train/loss"])), (event, line)
    # Validation (held out of train) at each evaluation; the test split once, at the end.
    assert [e.step for e in acc.Scalars("val/accuracy")] == [6, 12]
    assert [e.step for e in acc.Scalars("test/accuracy")] == [12]
    print(f"tensorboard: {len(tags)} scalar tags, train/loss at steps 1..12 matches metrics.jsonl")

    # A resume from step 6: the new event file starts with a SessionLog START at step 7, which
    # TensorBoard's reader takes as "drop what the earlier files hold from step 7 on". Each step
    # once, not the abandoned timeline's 7..12 and the resumed run's 7..12 both.
    loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=12",
         "--set", "trainer.eval_every=6",
         "--set", f"trainer.resume_from={os.path.join(run, 'checkpoints', 'step_00000006')}")
    assert len(glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))) == 2
    acc = EventAccumulator(os.path.join(run, "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == list(range(1, 13)), steps
    assert [e.step for e in acc.Scalars("val/accuracy")] == [6, 12], acc.Scalars("val/accuracy")
    assert [e.step for e in acc.Scalars("test/accuracy")] == [12], acc.Scalars("test/accuracy")
    print("tensorboard: after a resume from step 6, train/loss at steps 1..12 once each")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("readers test passed")
