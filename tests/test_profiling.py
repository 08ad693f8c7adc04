"""The step profiler: the summary's arithmetic on hand-made kernel timelines, and a profiled CPU run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent

import train
from training.profiling import (LOOPBACK, KernelInterval, _activities, classify, kernel_intervals,
                                loopback_ms, split_loopback, step_profile, summarize)


def _rows(summary: str) -> dict[str, list[str]]:
    """First cell -> the other cells, for every markdown table row."""
    rows = [line.strip("|").split(" | ") for line in summary.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


@pytest.mark.parametrize("name, category", [
    ("void cutlass::device_kernel<GemmUniversal<cutlass::gemm::GroupProblemShape<...>>>", "grouped GEMM (experts)"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "GEMM"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "GEMM"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::cunn_SoftMaxForward<8, float, float, float>", "cross-entropy / softmax"),
    ("Memcpy HtoD (Pageable -> Device)", "copy / cast"),
    ("void at::native::elementwise_kernel<direct_copy_kernel_cuda>", "copy / cast"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "index / permute"),
    ("_rms_norm_fwd_kernel", "norm / activation (Triton & elementwise)"),
    ("void at::native::vectorized_elementwise_kernel<4, silu_kernel>", "norm / activation (Triton & elementwise)"),
    ("some_custom_kernel", "other"),
])
def test_kernel_names_fall_into_their_category(name, category):
    assert classify(name) == category


def test_summary_merges_overlaps_and_measures_exposed_communication():
    # Two steps over 100 ms of wall time. Compute: a GEMM 0-30 ms overlapped by a grouped GEMM 20-50 ms on
    # another stream (union 0-50, not 60), then a norm kernel 70-80. Communication: 40-60 (10 ms hidden behind
    # the grouped GEMM, 10 exposed) and 85-95 (all exposed).
    ms = 1e3
    kernels = [
        KernelInterval("sm90_xmma_gemm_bf16", 0 * ms, 30 * ms, 7),
        KernelInterval("_grouped_mm_kernel", 20 * ms, 50 * ms, 13),
        KernelInterval("triton_rms_norm", 70 * ms, 80 * ms, 7),
        KernelInterval("ncclDevKernel_AllReduce_Sum_f32", 40 * ms, 60 * ms, 21),
        KernelInterval("ncclDevKernel_AllReduce_Sum_f32", 85 * ms, 95 * ms, 21),
    ]
    rows = _rows(summarize(kernels, wall_s=0.1, steps=2))
    assert rows["wall time"] == ["50.00", "100.0%"]
    assert rows["compute kernels busy (union over streams)"] == ["30.00", "60.0%"]  # (50 + 10) / 2
    assert rows["GPU idle (no compute kernel running)"] == ["20.00", "40.0%"]
    assert rows["GPU idle from the first compute kernel to the last"] == ["10.00", "20.0%"]  # 50-70 in 0-80
    assert rows["communication (union)"] == ["15.00", "30.0%"]
    assert rows["exposed communication (not overlapped by compute)"] == ["10.00", "20.0%"]  # (10 + 10) / 2
    # Category times are summed per kernel (overlap counts twice): 30 + 30 + 10 + 30 = 100 ms.
    assert rows["GEMM"] == ["15.00", "30.0%", "0.5"]
    assert rows["grouped GEMM (experts)"] == ["15.00", "30.0%", "0.5"]
    assert rows["communication"] == ["15.00", "30.0%", "1"]
    assert rows["norm / activation (Triton & elementwise)"] == ["5.00", "10.0%", "0.5"]
    assert rows["ncclDevKernel_AllReduce_Sum_f32"] == ["15.00", "1", "communication"]


def test_summary_truncates_long_kernel_names():
    name = "void cutlass::device_kernel<" + "x" * 200 + ">"
    summary = summarize([KernelInterval(name, 0.0, 1.0, 0)], wall_s=1e-3, steps=1)
    assert name[:77] + "..." in summary and name not in summary


def test_summary_without_device_kernels_says_so():
    summary = summarize([], wall_s=0.5, steps=2)
    assert _rows(summary)["wall time"] == ["250.00", "100.0%"]
    assert "No device kernels were recorded" in summary


@pytest.mark.torch_apis  # the profiler's FunctionEvent differs between torch versions
def test_kernel_intervals_keep_device_kernels_only():
    def event(name: str, device_type: torch.autograd.DeviceType, **kwargs) -> FunctionEvent:
        return FunctionEvent(id=0, name=name, thread=1, start_us=10.0, end_us=25.0, device_type=device_type,
                             device_resource_id=7, **kwargs)

    class Profile:  # what kernel_intervals reads of a stopped torch.profiler.profile
        def events(self) -> list[FunctionEvent]:
            return [event("aten::mm", torch.autograd.DeviceType.CPU),
                    event("ProfilerStep#2", torch.autograd.DeviceType.CUDA, is_user_annotation=True),
                    event("nvjet_tst_128x256", torch.autograd.DeviceType.CUDA)]

    assert kernel_intervals(Profile()) == [KernelInterval("nvjet_tst_128x256", 10.0, 25.0, 7)]


@pytest.mark.torch_apis  # the profiler's FunctionEvent differs between torch versions
def test_loopback_copies_are_counted_apart_from_compute():
    # A loopback all-to-all range launches a 4 us device-to-device copy (through a child op) beside a compute copy
    # of the same name but 3 us and a GEMM: the loopback copy leaves the categories and the busy time, and is
    # reported on its own line and by collective.
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name: str, start: float, end: float, device_type=cpu) -> FunctionEvent:
        return FunctionEvent(id=0, name=name, thread=1, start_us=start, end_us=end, device_type=device_type,
                             device_resource_id=7, use_device="cuda")

    copy = "Memcpy DtoD (Device -> Device)"
    loopback_range, launch = event("loopback all_to_all", 0.0, 5.0), event("aten::copy_", 1.0, 4.0)
    launch.append_kernel(copy, 0, 4.0)
    loopback_range.append_cpu_child(launch)
    device = [event(copy, 10.0, 13.0, cuda), event(copy, 20.0, 24.0, cuda), event("nvjet_tst_gemm", 30.0, 40.0, cuda)]

    class Profile:
        def events(self) -> list[FunctionEvent]:
            return [loopback_range, launch, *device]

    kernels, copies = split_loopback(Profile(), kernel_intervals(Profile()))
    assert copies == [KernelInterval(copy, 20.0, 24.0, 7)]
    assert [k.name for k in kernels] == [copy, "nvjet_tst_gemm"]
    rows = _rows(summarize(kernels, wall_s=50e-6, steps=1, loopback=copies))
    assert rows["compute kernels busy (union over streams)"][0] == "0.01"  # 3 + 10 us, not 17
    assert rows["copy / cast"][0] == "0.00" and rows[LOOPBACK][2] == "1"
    profile = step_profile(kernels, 50e-6, 1, loopback_ms(Profile(), 1))
    assert profile["categories_ms"] == {"copy / cast": pytest.approx(3e-3), "GEMM": pytest.approx(10e-3)}
    assert profile["busy_ms"] == pytest.approx(13e-3)
    assert profile["loopback_ms"] == {"all_to_all": pytest.approx(4e-3)}


@pytest.mark.torch_apis  # the profiler's FunctionEvent differs between torch versions
def test_two_profiled_steps_give_per_step_figures():
    """scripts/simulate.py profiles two steps: every figure is per step, the loopback copies too (with one step a
    missing division by the steps changes nothing)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name: str, start: float, end: float, device_type=cpu) -> FunctionEvent:
        return FunctionEvent(id=0, name=name, thread=1, start_us=start, end_us=end, device_type=device_type,
                             device_resource_id=7, use_device="cuda")

    copy = "Memcpy DtoD (Device -> Device)"
    ranges = []
    for start in (0.0, 100.0):  # one loopback all-to-all per step, each launching a 6 us copy
        loopback_range, launch = event("loopback all_to_all", start, start + 8), event("aten::copy_", start + 1, start + 7)
        launch.append_kernel(copy, 0, 6.0)
        loopback_range.append_cpu_child(launch)
        ranges += [loopback_range, launch]
    device = [event(copy, 10.0, 16.0, cuda), event("nvjet_tst_gemm", 20.0, 60.0, cuda),
              event(copy, 110.0, 116.0, cuda), event("nvjet_tst_gemm", 120.0, 140.0, cuda)]

    class Profile:
        def events(self) -> list[FunctionEvent]:
            return [*ranges, *device]

    kernels, copies = split_loopback(Profile(), kernel_intervals(Profile()))
    assert len(copies) == 2 and [k.name for k in kernels] == ["nvjet_tst_gemm"] * 2
    assert loopback_ms(Profile(), 2) == {"all_to_all": pytest.approx(6e-3)}  # 12 us over 2 steps
    profile = step_profile(kernels, 200e-6, 2, loopback_ms(Profile(), 2))
    assert profile["wall_ms"] == pytest.approx(0.1) and profile["busy_ms"] == pytest.approx(0.03)  # (40 + 20) / 2
    assert profile["idle_ms"] == pytest.approx(0.07)
    assert profile["categories_ms"] == {"GEMM": pytest.approx(0.03)}
    rows = _rows(summarize(kernels, wall_s=200e-6, steps=2, loopback=copies))
    assert rows["wall time"][0] == "0.10" and rows["compute kernels busy (union over streams)"][0] == "0.03"
    assert rows[LOOPBACK][0] == "0.01" and rows[LOOPBACK][2] == "1"  # 6 us and one copy a step
    assert rows["GEMM"][0] == "0.03" and rows["GEMM"][2] == "1"


def test_profiled_cpu_run_writes_trace_and_summary(tiny_run_config):
    cfg = tiny_run_config("train.steps=3", "train.save_final=false", "logging.profile_step=2",
                          "logging.profile_steps=1")
    train.run(cfg)
    profile = Path(cfg.train.output_dir) / "profile"
    trace = json.loads(gzip.decompress((profile / "trace_rank0.json.gz").read_bytes()))
    assert trace["traceEvents"]
    summary = (profile / "summary_rank0.md").read_text()
    assert summary.startswith("# Profile of steps 2..2, rank 0")
    assert "| wall time |" in summary and "No device kernels were recorded" in summary


def test_a_run_that_ends_inside_the_window_still_writes_its_summary(tiny_run_config):
    cfg = tiny_run_config("train.steps=2", "train.save_final=false", "logging.profile_step=2",
                          "logging.profile_steps=5")
    train.run(cfg)
    assert (Path(cfg.train.output_dir) / "profile" / "summary_rank0.md").read_text().startswith(
        "# Profile of steps 2..2, rank 0")


@pytest.mark.parametrize("overrides, message", [
    (["logging.profile_step=-1"], "logging.profile_step=-1 must be >= 0"),
    (["train.steps=3", "logging.profile_step=4"], r"logging.profile_step=4 is past the last step"),
    (["logging.profile_step=1", "logging.profile_steps=0"], "logging.profile_steps=0 must be >= 1"),
])
def test_bad_profile_settings_are_rejected_by_key(tiny_run_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        train.run(tiny_run_config(*overrides))


def test_profile_host_false_records_only_cuda_kernels() -> None:
    """logging.profile_host=false leaves the host unrecorded on CUDA (its idle figure is then the step's own);
    elsewhere the host ops are all a profile has, so they stay."""
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    assert _activities("cuda", host=False) == [cuda]
    assert _activities("cuda") == [cpu, cuda]
    assert _activities("cpu", host=False) == [cpu] and _activities("npu", host=False) == [cpu]
