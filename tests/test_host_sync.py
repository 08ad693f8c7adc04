"""No host sync inside the training step on the default single-device path, but the listed ones.

On a GPU a host sync (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, boolean-mask indexing, a tensor built
from host data, which is a blocking copy) stalls the host until the device catches up, and the device then idles
while the host launches the next kernels. ``torch.cuda.set_sync_debug_mode`` finds them on CUDA only; on CPU this
test records every op of one train step that would sync on a device (a dispatch mode, which also sees autograd's
backward and the optimizer) plus every ``Tensor.tolist``, attributes each to the innermost frame of this repository
(or of torch.optim), and compares the result with the list that stays (``EXPECTED`` below, each entry with why it
stays). A new ``.item()`` anywhere in the step fails it.

The grouped GEMM runs ``torch._grouped_mm`` (the registry's CUDA choice, which also runs on CPU); its CPU reference,
the per-expert loop, reads the group sizes on the host by design.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
import training.optim
from kernels import installed
from kernels.moe.grouped_mm import native_grouped_mm

pytestmark = pytest.mark.torch_apis  # torch._grouped_mm, host-syncing ops

REPO = Path(__file__).resolve().parents[1]
TORCH_OPTIM = str(Path(torch.optim.__file__).parent)
aten = torch.ops.aten

# Ops that read device data on the host (or whose output shape depends on it, which does the same).
_SYNCING = {aten._local_scalar_dense.default: "item", aten.nonzero.default: "nonzero",
            aten.masked_select.default: "masked_select", aten._unique2.default: "unique",
            aten.unique_dim.default: "unique", aten.unique_consecutive.default: "unique",
            aten.bincount.default: "bincount", aten.equal.default: "equal",
            aten.lift_fresh.default: "tensor from host data"}

# (file, function, what) -> how many times one step of the tiny model (one micro-batch) does it, and why it stays.
EXPECTED = {
    # The step's one deliberate read: loss and grad norm, which decide whether the optimizer may step.
    ("train.py", "train_step", "tolist"): 1,
}
# Non-fused torch.optim AdamW keeps its step counters on the host: created from host data at the first step and
# read there, no device data involved (so does the CUDA default, training.optim.AdamW).
HOST_STEP_COUNTERS = {(TORCH_OPTIM, "_get_value", "item"), (TORCH_OPTIM, "_init_group", "tensor from host data"),
                      ("training/optim.py", "step", "item"), ("training/optim.py", "step", "tensor from host data")}
# The optimizers: torch's foreach AdamW (the CPU default) and training.optim.AdamW (the CUDA default; here with bf16
# moments, its torch reference), whose update is queued before the read.
OPTIMIZERS = ["optim.state_dtype=float32", "optim.state_dtype=bfloat16"]


def _site() -> tuple[str, str]:
    """The innermost frame of this repository (tests and installed packages excluded: a venv may live inside it,
    as CI's torch 2.11 one does) or of torch.optim."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(TORCH_OPTIM):
            return TORCH_OPTIM, frame.f_code.co_name
        if path.startswith(str(REPO)) and "/tests/" not in path and "/site-packages/" not in path:
            return str(Path(path).relative_to(REPO)), frame.f_code.co_name
        frame = frame.f_back
    return "<torch>", "?"


class SyncRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _SYNCING.get(func)
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            what = "repeat_interleave without output_size"
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            what = "boolean-mask indexing"
        if what is not None:
            self.seen[(*_site(), what)] += 1
        return func(*args, **kwargs)


# Qwen3.5 with its vision tower, on token data with images (tests/vision_data.py): the tower's index tables are the
# host's (models.qwen3_5_moe.vision.vision_inputs), so its forward and backward read nothing either.
VISION = ["model=qwen35_moe_debug", "model.arch.hidden_size=32", "model.arch.head_dim=8",
          "model.arch.moe_intermediate_size=16", "model.arch.shared_expert_intermediate_size=16",
          "model.tokenizer=none", "data.seq_len=32", "optim.state_dtype=float32"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS + ["vision"])
def test_one_train_step_syncs_only_where_listed(tiny_run_config, monkeypatch, optimizer: str) -> None:
    if optimizer == "vision":
        from tests.vision_data import WithImages, vision_overrides
        from training.startup import resolve_model

        cfg = tiny_run_config("train.steps=2", "logging.routing_every=0", "logging.log_every=100", *VISION,
                              *vision_overrides())
        vision, loader = resolve_model(cfg)[1].vision_config, train.build_data_loader
        monkeypatch.setattr(train, "build_data_loader", lambda *a, **k: WithImages(loader(*a, **k), vision))
    else:
        cfg = tiny_run_config("train.steps=2", "logging.routing_every=0", "logging.log_every=100", optimizer)
    recorder = SyncRecorder()
    tolist = torch.Tensor.tolist

    def recording_tolist(self):
        recorder.seen[(*_site(), "tolist")] += 1
        return tolist(self)

    def recorded_step(*args, **kwargs):
        with recorder, monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", recording_tolist)
            installed.put("cpu", "grouped_mm", native_grouped_mm)  # after apply_kernels: the device's choice
            return original(*args, **kwargs)

    original = train.train_step
    saved = installed.snapshot()
    monkeypatch.setattr(train, "train_step", recorded_step)
    try:
        train.run(cfg)
    finally:
        installed.restore(saved)
    per_step = {key: n / 2 for key, n in recorder.seen.items() if key not in HOST_STEP_COUNTERS}
    assert per_step == EXPECTED


def test_the_update_is_queued_before_the_steps_read(tiny_run_config, monkeypatch) -> None:
    """With training.optim.AdamW every parameter's update is launched before the step's one host read (so the
    device goes from backward to the optimizer without waiting for the host), and none after it."""
    events: list[str] = []
    tolist, adamw_step_, original = torch.Tensor.tolist, training.optim.adamw_step_, train.train_step

    def recording_tolist(self):
        if sys._getframe(1).f_code is original.__code__:  # the step's read (torch calls tolist too)
            events.append("read")
        return tolist(self)

    def recording_adamw_step_(*args, **kwargs):
        events.append("update")
        return adamw_step_(*args, **kwargs)

    monkeypatch.setattr(training.optim, "adamw_step_", recording_adamw_step_)

    def recorded_step(*args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "tolist", recording_tolist)
            return original(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", recorded_step)
    train.run(tiny_run_config("train.steps=2", "logging.routing_every=0", "optim.state_dtype=bfloat16"))
    steps = "".join("u" if e == "update" else "r" for e in events).split("r")
    assert len(steps) == 3 and steps[0] and steps[1] and not steps[2], events  # updates, read, updates, read


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a queued copy to pinned memory)")
def test_a_queued_read_gives_the_values_at_the_call_not_the_later_writes() -> None:
    from core import device

    t = torch.arange(4.0, device="cuda")
    read = device.queued_read(t)
    for _ in range(50):  # queued after the copy: the read does not wait for these, nor see them
        t.mul_(1.5)
    assert read().tolist() == [0.0, 1.0, 2.0, 3.0] and read().device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.set_sync_debug_mode")
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_on_cuda_a_step_syncs_only_in_its_one_read(tiny_run_config, monkeypatch, optimizer: str) -> None:
    """On the GPU, with the trainer's kernels and bf16: every step after two warm-up steps (Triton's first launches
    compile and autotune, which sync) prepares its batches, queues its kernels and resolves its read's decisions
    under ``torch.cuda.set_sync_debug_mode("error")``, so any sync outside train_step's one read raises."""
    strict = {"on": False}

    def checked(fn):
        def call(*args, **kwargs):
            if not strict["on"]:
                return fn(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return call

    steps, original = [], train.train_step

    def counted_step(*args, **kwargs):
        result = original(*args, **kwargs)
        steps.append(1)
        strict["on"] = len(steps) >= 2
        return result

    for name in ("prepare_batches", "queue_step", "resolve_step"):
        monkeypatch.setattr(train, name, checked(getattr(train, name)))
    monkeypatch.setattr(train, "train_step", counted_step)
    history = train.run(tiny_run_config("train.steps=8", "train.device=cuda", "logging.log_every=100",
                                        "logging.routing_every=0", optimizer))
    assert [m["step"] for m in history] == list(range(1, 9)) and len(steps) == 8
