"""The links emulated in the loopback world (``launch.links``, ``parallelisms/loopback.py``, ``parallelisms/links.py``).

On the CPU: the link arithmetic against hand-computed values; a collective's hold is its bytes per peer over its
group's rate, asked of the registry's timer after the kernels are installed; the values of a simulated step do not
change; and what a step holds, per collective kind and mesh, is the planner's link time of that step. The timer is a
recorder here (no sleeping, no timing assertion). On a GPU (skipped elsewhere; scripts/gpu/issue62.sh runs them): the
stream semantics, measured with device events (the one place that asserts time: the emulation's purpose).
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

import train
from kernels import installed
from parallelisms import loopback
from parallelisms.links import LinkConfig, all_to_all_seconds, link_errors, ring_seconds
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from tests.test_plan import PLANNED_MESHES
from training.planner import PlanConfig, plan

pytestmark = pytest.mark.torch_apis  # a Python process-group backend and its Work (c10d's trampolines)

LINKS = LinkConfig(emulate=True, a2a_gb_s=100.0, nvlink_gb_s=400.0, internode_gb_s=50.0, gpus_per_node=4,
                   comm_sms=20, ring_sms=12)


def test_link_seconds_by_hand():
    GB = 1e9
    # A ring inside a node: all-gather sends (P-1) inputs, reduce-scatter (P-1)/P of its input, all-reduce twice that
    assert ring_seconds("all_gather", GB, [0, 1, 2, 3], LINKS) == pytest.approx(3 / 400)
    assert ring_seconds("reduce_scatter", GB, [0, 1, 2, 3], LINKS) == pytest.approx(0.75 / 400)
    assert ring_seconds("all_reduce", GB, [0, 1, 2, 3], LINKS) == pytest.approx(1.5 / 400)
    assert ring_seconds("all_gather", GB, [3, 4], LINKS) == pytest.approx(1 / 50)  # across nodes: the NIC's
    assert ring_seconds("all_gather", GB, [5], LINKS) == 0.0
    # An all-to-all: the chunk kept crosses nothing; node peers at a2a_gb_s, other nodes at the NIC's, at once
    assert all_to_all_seconds([GB, 2 * GB, 3 * GB, 4 * GB], [0, 1, 2, 3], 1, LINKS) == pytest.approx(8 / 100)
    assert all_to_all_seconds([GB, GB, GB, GB], [2, 3, 4, 5], 0, LINKS) == pytest.approx(max(1 / 100, 2 / 50))
    assert all_to_all_seconds([GB, GB], [0, 1], 0, LINKS, a2a_gb_s=200.0) == pytest.approx(1 / 200)
    assert link_errors(LinkConfig(a2a_gb_s=0, comm_sms=0, ring_sms=0)) == [
        "launch.links.a2a_gb_s=0 must be > 0 (GB/s per GPU and direction)", "launch.links.comm_sms=0 must be >= 1",
        "launch.links.ring_sms=0 must be >= 1"]


class Recorder:
    """A link timer that records each hold (ns, sms), whether the registry had installed its timer for the CPU by
    then, and never sleeps."""

    def __init__(self) -> None:
        self.holds: list[tuple[int, int]] = []
        self.installed: list[bool] = []

    def clock(self, like):
        self.installed.append(("cpu", "link_timer") in installed.snapshot())
        return torch.zeros(1, dtype=torch.int64)

    def hold(self, start, ns, sms, like=None):
        self.holds.append((ns, sms))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(loopback, "link_timer", lambda like: rec)
    loopback.HELD.clear()
    yield rec
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_collective_holds_its_link_time_and_returns_the_copies(recorder):
    slow = LinkConfig(emulate=True, a2a_gb_s=1e-3, nvlink_gb_s=4e-3, internode_gb_s=5e-4, gpus_per_node=4,
                      comm_sms=20, ring_sms=12)  # bytes per microsecond: every hold a whole number of ns
    loopback.init_loopback_world(8, 5, "cpu", slow)  # rank 5: node 1 of 4 GPUs a node
    group = dist.new_group([2, 3, 4, 5])  # two nodes: rank 5 is group rank 3, rank 4 its node's peer
    x = torch.arange(48.0).view(12, 4).requires_grad_()
    y = all_to_all_single_autograd(x, [1, 2, 5, 4], [1, 2, 5, 4], group)
    torch.testing.assert_close(y, x.detach(), rtol=0, atol=0)  # every peer returns what it was sent
    # 16 bytes a row: 5 rows to the node's peer at 1 MB/s (80 us), 1 + 2 rows to the other node at 0.5 MB/s (96 us),
    # at once; the 4 rows kept cross nothing
    assert recorder.holds == [(96_000, 20)]
    (y * 2).sum().backward()  # the gradient's all-to-all back holds as long
    assert recorder.holds[1] == recorder.holds[0] and torch.equal(x.grad, torch.full_like(x, 2.0))
    out = torch.empty(8)
    dist.all_gather_into_tensor(out, torch.arange(4.0), group=dist.new_group([4, 5]))  # a ring in one node
    # 16 B at 4 MB/s, on the rings' SMs
    assert torch.equal(out, torch.arange(4.0).repeat(2)) and recorder.holds[2] == (4_000, 12)
    dist.all_gather_into_tensor(out, torch.arange(4.0), group=dist.new_group([3, 5]))  # across nodes: the NIC's
    assert recorder.holds[3] == (32_000, 12)
    dist.all_reduce(torch.ones(2), group=dist.new_group([5]))  # a group of one rank takes no time
    assert len(recorder.holds) == 4
    kinds = collections.Counter(kind for kind, _ in loopback.HELD)
    assert kinds == {"all_to_all": 1, "all_gather": 2}


def _simulated_step(tmp_path, links: bool) -> dict:
    tokens = write_tokens(tmp_path / "tokens.npy", 4096)
    cfg = compose_config([*TINY_MODEL, "parallel=ep2", "dispatcher=fused", "model.arch.router_force_balance=true",
                          "data=tokens", f"data.path={tokens}", "data.seq_len=16", f"data.cache_dir={tmp_path / 'c'}",
                          f"train.output_dir={tmp_path / ('on' if links else 'off')}", "train.steps=1",
                          "train.local_batch_size=2", "train.save_final=false", "train.device=cpu",
                          "train.mixed_precision=fp32", "logging.tensorboard=false", "launch.simulate_world=4",
                          "launch.simulate_rank=1", *([f"launch.links.{k}={v}" for k, v in vars(LINKS).items()]
                                                      if links else [])])
    built = []
    build_model = train.build_model

    def keep(*args, **kwargs):
        built.append(build_model(*args, **kwargs))
        return built[-1]

    dims = []
    build_dims = train.parallelisms.build_parallel_dims

    def keep_dims(*args, **kwargs):
        dims.append(build_dims(*args, **kwargs))
        return dims[-1]

    loopback.HELD.clear()
    try:
        torch.manual_seed(0)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(train, "build_model", keep)
            m.setattr(train.parallelisms, "build_parallel_dims", keep_dims)
            history = train.run(cfg)
        groups = {}
        for planned, name in PLANNED_MESHES.items():
            if name in dims[0].meshes and dims[0].mesh(name).size() > 1:
                groups.setdefault(dims[0].mesh(name).get_group().group_name, []).append(planned)
        held = collections.Counter()
        for (kind, group), seconds in loopback.HELD.items():
            held[kind, "+".join(groups.get(group, ["other"]))] += seconds
        model = built[0][0]
        grads = {n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        return {"cfg": cfg, "loss": history[0]["loss"], "grads": grads, "held": held}
    finally:
        dist.destroy_process_group()


def test_a_step_with_links_is_the_step_without_and_holds_the_planned_link_time(recorder, tmp_path):
    off = _simulated_step(tmp_path, links=False)
    assert not recorder.holds
    on = _simulated_step(tmp_path, links=True)
    assert on["loss"] == off["loss"] and on["grads"].keys() == off["grads"].keys()
    for name, grad in on["grads"].items():
        torch.testing.assert_close(grad, off["grads"][name], rtol=0, atol=0)
    assert recorder.holds and all(recorder.installed)  # no timed collective before the registry chose the timer
    assert {sms for _, sms in recorder.holds} == {LINKS.comm_sms, LINKS.ring_sms}  # the all-to-alls', FSDP's rings
    # Per (kind, mesh), the planner's link time of the step at the same rates (the loss and norm all-reduces of a
    # few scalars are not planned)
    machine = PlanConfig(gpus=4, gpus_per_node=LINKS.gpus_per_node, nvlink_gb_s=LINKS.nvlink_gb_s,
                         internode_gb_s=LINKS.internode_gb_s, a2a_gb_s=LINKS.a2a_gb_s)
    group_of = {mesh: key[1] for key in on["held"] for mesh in key[1].split("+")}
    planned = collections.Counter()
    for c in plan(on["cfg"], machine).collectives:
        planned[c.kind, group_of.get(c.mesh, c.mesh)] += c.seconds
    held = {k: v for k, v in on["held"].items() if k[0] != "all_reduce"}
    assert held.keys() == planned.keys() and {"all_to_all", "all_gather", "reduce_scatter"} == {k for k, _ in held}
    for key, seconds in planned.items():
        assert held[key] == pytest.approx(seconds, rel=1e-9), key


def test_links_need_a_simulation_and_rates_above_zero():
    from training.config import validate

    with pytest.raises(ValueError, match=r"^launch.links.emulate=true needs launch.simulate_world"):
        validate(compose_config(["launch.links.emulate=true"]))
    with pytest.raises(ValueError, match=r"^launch.links.internode_gb_s=0.0 must be > 0"):
        validate(compose_config(["launch.simulate_world=4", "train.save_final=false", "launch.links.emulate=true",
                                 "launch.links.internode_gb_s=0"]))


# ------------------------------------------------------------------------------------------ on a GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream semantics need a GPU")
HOLD_S = 0.02  # 20 ms: far above a launch, far below a test's patience


@pytest.fixture
def gpu_world():
    from kernels.config import KernelConfig
    from kernels.registry import installed_kernels, select_kernels

    loopback.init_loopback_world(2, 0, "cuda", LinkConfig(emulate=True, a2a_gb_s=1.0, nvlink_gb_s=1.0,
                                                          gpus_per_node=8))
    with installed_kernels(select_kernels(KernelConfig(), "cuda")):
        group = dist.new_group([0, 1])
        # Every path a test times, once, at the timed sizes, before anything is timed: the timer's kernels compiled
        # (Triton specialises on the hold's ns), c10d's functional ops and a side stream's first use set up. On
        # the first GPU run (H100, 2026-12-07) the functional all-to-all and the side-stream all-gather, timed on
        # their first call, spent 21 and 11 ms on the host, with the hold itself on time.
        x = torch.randn(_rows_for(HOLD_S), 1024, device="cuda")
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
        dist.all_to_all_single(torch.empty_like(x), x, group=group, async_op=True).wait()
        (all_to_all_single_autograd(x, None, None, group) * 1).sum()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            half = x[: x.shape[0] // 2]
            dist.all_gather_into_tensor(torch.empty(2 * half.shape[0], 1024, device="cuda"), half, group=group)
        torch.cuda.synchronize()
        yield group
    dist.destroy_process_group()


def _rows_for(seconds: float) -> int:
    """Rows of 1,024 fp32 that take ``seconds`` to leave the GPU at 1 GB/s (half of them stay; even, as an
    all-to-all of 2 without split sizes needs)."""
    return 2 * int(seconds * 1e9 / 4096)


def _elapsed(fn) -> tuple[float, float]:
    """(device seconds from before ``fn`` to the current stream's next point, host seconds ``fn`` took)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    host = time.perf_counter()
    fn()
    host = time.perf_counter() - host
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3, host


@cuda
def test_gpu_a_synchronous_all_to_all_holds_the_callers_stream_not_the_host(gpu_world):
    x = torch.randn(_rows_for(HOLD_S), 1024, device="cuda")
    out = torch.empty_like(x)
    device_s, host_s = _elapsed(lambda: dist.all_to_all_single(out, x, group=gpu_world))
    assert device_s == pytest.approx(HOLD_S, rel=0.1) and host_s < HOLD_S / 2
    assert torch.equal(out, x)


@cuda
def test_gpu_an_async_all_to_all_overlaps_compute_until_waited(gpu_world):
    x = torch.randn(_rows_for(HOLD_S), 1024, device="cuda")
    out = torch.empty_like(x)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one_s, _ = _elapsed(lambda: [a @ a for _ in range(10)])
    n = max(10, int(10 * 0.8 * HOLD_S / one_s))  # matmuls of about 0.8 of the hold
    matmul_s, _ = _elapsed(lambda: [a @ a for _ in range(n)])

    def overlapped():
        work = dist.all_to_all_single(out, x, group=gpu_world, async_op=True)
        for _ in range(n):
            a @ a  # on the compute stream, beside the link's hold (on its 24 SMs of the GPU's)
        work.wait()

    both_s, _ = _elapsed(overlapped)
    assert both_s < HOLD_S + 0.5 * matmul_s, (both_s, HOLD_S, matmul_s)  # mostly overlapped, not the sum
    assert both_s >= HOLD_S * 0.9 and torch.equal(out, x)


@cuda
def test_gpu_a_functional_all_to_all_waits_at_first_use(gpu_world):
    x = torch.randn(_rows_for(HOLD_S), 1024, device="cuda")
    device_s, host_s = _elapsed(lambda: all_to_all_single_autograd(x, None, None, gpu_world) * 1)
    assert device_s == pytest.approx(HOLD_S, rel=0.1) and host_s < HOLD_S / 2


@cuda
def test_gpu_a_collective_issued_on_a_side_stream_holds_that_stream_not_the_default(gpu_world):
    """FSDP's all-gather runs on its own stream, which the compute stream then waits on through an event: the
    emulated all-gather holds the stream it was issued on, and the default stream runs on."""
    x = torch.randn(_rows_for(HOLD_S) // 2, 1024, device="cuda")  # an all-gather of 2 sends its whole input
    out = torch.empty(2 * x.shape[0], 1024, device="cuda")
    side = torch.cuda.Stream()
    begin, side_end, default_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    begin.record()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_gather_into_tensor(out, x, group=gpu_world)
        side_end.record()
    default_end.record()
    torch.cuda.synchronize()
    # at 1 GB/s the ring sends x once: HOLD_S on the side stream, nothing on the default one
    assert begin.elapsed_time(side_end) / 1e3 == pytest.approx(HOLD_S, rel=0.1)
    assert begin.elapsed_time(default_end) / 1e3 < HOLD_S / 2
    assert torch.equal(out, x.repeat(2, 1))
