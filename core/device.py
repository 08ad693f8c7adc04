"""The one place that knows which accelerator we run on (cpu / cuda / npu).

Everything else asks this module for the device, the collective backend, memory statistics and
synchronisation, instead of calling ``torch.cuda`` directly. ``torch_npu`` is imported lazily, only
when an Ascend NPU is requested or detected.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable

import torch

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


NPU_EXTRA = "pip install '.[npu]' (torch-npu of torch's own version, with its CANN: README, Ascend NPUs)"


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _import_torch_npu():
    """torch_npu, which registers torch.npu. Each torch-npu release is built against one torch minor: another
    minor fails later in obscure ways, so a mismatch is refused here, naming both."""
    import torch_npu

    if _minor(torch_npu.__version__) != _minor(torch.__version__):
        raise RuntimeError(f"torch-npu {torch_npu.__version__} is built for torch {_minor(torch_npu.__version__)}, "
                           f"but torch is {torch.__version__}: {NPU_EXTRA}")
    return torch_npu


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    _import_torch_npu()
    return torch.npu.is_available()


@functools.lru_cache(maxsize=None)
def device_type(requested: str = "auto") -> str:
    """Resolve ``requested`` ('auto', 'cpu', 'cuda', 'npu') to an available device type."""
    if requested not in ("auto", "cpu", "cuda", "npu"):
        raise ValueError(f"train.device={requested!r} is not one of auto, cpu, cuda, npu")
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "npu" if _npu_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    if requested == "npu" and not _npu_available():
        raise ValueError(f"train.device=npu but torch_npu is missing or sees no NPU; {NPU_EXTRA}")
    return requested


def module(dev_type: str):
    """The torch submodule for an accelerator (``torch.cuda`` / ``torch.npu``)."""
    if dev_type == "npu":
        _import_torch_npu()
    return getattr(torch, dev_type)


def local_device(dev_type: str) -> torch.device:
    """This process's device: accelerator number LOCAL_RANK, or the CPU."""
    if dev_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0))
    module(dev_type).set_device(index)
    return torch.device(dev_type, index)


def dist_backend(dev_type: str) -> str:
    return _BACKENDS[dev_type]


def synchronize(dev_type: str) -> None:
    if dev_type != "cpu":
        module(dev_type).synchronize()


def queued_copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The host tensor ``t`` on ``dev``. On an accelerator through pinned memory, so the copy is queued and the host
    goes on: a copy from pageable memory would wait until the device has run everything queued before it (the
    training loop fetches the next batch while the device still runs the previous step's optimizer). A tensor whose
    elements share memory (an ``expand``) is made contiguous first: pinning copies it, which such a tensor refuses."""
    if t.device.type != "cpu":
        raise ValueError(f"queued_copy takes a host tensor; this one is on {t.device} already (copied twice?)")
    return t if dev.type == "cpu" else t.contiguous().pin_memory().to(dev, non_blocking=True)


def queued_read(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Queue a copy of ``t`` to the host; the function returned waits for that copy alone and gives the host
    tensor. Work queued on the device after this call (the optimizer's update) goes on running while the host
    reads, where a plain ``.tolist()`` would wait for it too. On the CPU, ``t`` itself."""
    if t.device.type == "cpu":
        return lambda: t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    copied = module(t.device.type).Event()
    copied.record()

    def read() -> torch.Tensor:
        copied.synchronize()
        return host

    return read


def to_device(batch: dict[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``batch`` through ``queued_copy``."""
    return {k: queued_copy(v, dev) for k, v in batch.items()}


def time_ms(dev_type: str, step: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Mean device time of ``step()`` over ``iters`` back-to-back calls after ``warmup`` (device events; the host
    is not synchronised in between, as in a training step)."""
    mod = module(dev_type)
    for _ in range(warmup):
        step()
    start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    mod.synchronize()
    return start.elapsed_time(end) / iters


def reset_peak_memory(dev_type: str) -> None:
    if dev_type != "cpu":
        module(dev_type).reset_peak_memory_stats()


def peak_memory_gib(dev_type: str) -> float:
    """Peak allocated accelerator memory since the last reset; on CPU the process's max RSS."""
    if dev_type == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return module(dev_type).max_memory_allocated() / 2**30


def capacity_gib(dev_type: str) -> float | None:
    """This process's accelerator's memory (None on CPU)."""
    if dev_type == "cpu":
        return None
    mod = module(dev_type)
    return mod.get_device_properties(mod.current_device()).total_memory / 2**30


# Dense bf16 peak of one device, for MFU, by a part of its name (the first match counts, so longer names first).
# Unknown devices report mfu 0 rather than a made-up number. Ascend: torch_npu.npu.get_device_name(); A2 is the
# Ascend910B1..B4, A3 Ascend910_93xx (one of an Ascend 910C's two dies per device, each with a 910B's cube units).
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "H20": 148.0,
                     "Ascend910B1": 414.0, "Ascend910B2": 376.0, "Ascend910B3": 313.0, "Ascend910B4": 280.0,
                     "Ascend910_93": 376.0}


def peak_tflops(dev_type: str) -> float | None:
    if dev_type == "cpu":
        return None
    name = module(dev_type).get_device_name()
    for key, tflops in _PEAK_BF16_TFLOPS.items():
        if key.lower() in name.replace(" ", "").lower():
            return tflops
    return None
