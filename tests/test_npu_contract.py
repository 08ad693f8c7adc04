"""The Ascend NPU path against torch_npu's documented contracts, on CPU with the fake torch_npu on its DOCUMENTED
contract (tests/fake_torch_npu.py): MC2's limits (chip, ep, experts, top-k at parallelize time; bytes per all-to-all
at run time), one expert per rank, the permute's index dtype and bf16 tokens, the NPU ops kept by selective
activation checkpointing, the fake's own checks, core/device.py's npu branches (torch-npu pairing, A2 / A3 peaks)
and the install hints. The real kernels need an Ascend machine."""

from __future__ import annotations

import importlib.util

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import models
from core import device
from kernels.config import KernelConfig
from kernels.moe import npu as npu_moe
from kernels.moe.grouped_mm import per_group_mm
from kernels.registry import Env, select_kernels
from parallelisms import build_parallel_dims, parallelize_qwen3_moe
from parallelisms.activation_checkpoint import apply_activation_checkpointing
from parallelisms.dispatchers import npu
from parallelisms.dispatchers.common import Splits
from parallelisms.dispatchers.mc2 import Mc2Dispatcher, check_bytes
from tests.conftest import compose_config
from tests.dist_utils import debug_model_args
from tests.fake_torch_npu import A2, A3, DOCUMENTED, FakeTorchNpu, install


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    return install(FakeTorchNpu(DOCUMENTED), monkeypatch)


@pytest.fixture
def fake_world():
    """A fake 8-rank default process group (nothing communicates): enough to build meshes and dispatchers."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    yield dist.group.WORLD
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- MC2: chip, layout, bytes

@pytest.mark.parametrize("ep, num_experts, top_k, match", [
    (2, 8, 2, r"^dispatcher=mc2 needs parallel.ep_size in \{8,16,32,64\}, got ep=2; use dispatcher=fused$"),
    (128, 256, 8, r"parallel.ep_size in \{8,16,32,64\}, got ep=128"),
    (8, 512, 8, r"at most 32 experts per ep rank, got model.arch.num_experts / parallel.ep_size = 512 / 8 = 64; "
                r"use dispatcher=fused$"),
    (64, 512, 8, r"at most 256 experts in all, model.arch.num_experts=512; use dispatcher=fused$"),
    (8, 8, 1, r"takes top-k 2..8, got model.arch.num_experts_per_tok=1; use dispatcher=fused$"),
    (8, 128, 9, r"top-k 2..8, got model.arch.num_experts_per_tok=9"),
])
def test_mc2_layout_outside_the_documented_limits_fails_naming_the_key(ep, num_experts, top_k, match) -> None:
    with pytest.raises(ValueError, match=match):
        Mc2Dispatcher.check_layout(ep, num_experts, top_k)


@pytest.mark.parametrize("ep, num_experts, top_k", [(8, 8, 2), (8, 256, 8), (64, 128, 8), (16, 128, 8)])
def test_mc2_layout_inside_the_limits_passes(ep: int, num_experts: int, top_k: int) -> None:
    Mc2Dispatcher.check_layout(ep, num_experts, top_k)  # the edges: 1 and 32 per rank, 256 in all, top-k 2 and 8


@pytest.mark.parametrize("parallel, top_k, match", [
    ("ep2", 2, r"needs parallel.ep_size in \{8,16,32,64\}, got ep=2"),
    ("ep8", 1, r"takes top-k 2..8, got model.arch.num_experts_per_tok=1"),
])
def test_mc2_limits_fail_at_parallelize_time(fake_world, parallel: str, top_k: int, match: str) -> None:
    # The model stays on meta and the group is fake: the check runs before any dispatcher or collective.
    cfg = compose_config([f"parallel={parallel}", "dispatcher=mc2"])
    dims = build_parallel_dims(cfg.parallel, 8, 1, "cpu")
    spec = models.get_spec("qwen3_moe")
    with torch.device("meta"):
        model = spec.model_cls(debug_model_args(num_experts_per_tok=top_k))
    with pytest.raises(ValueError, match=match):
        parallelize_qwen3_moe(model, spec, dims, cfg.parallel, torch.float32, torch.float32, cfg.dispatcher)


def test_mc2_runs_on_a3_only(fake: FakeTorchNpu, fake_world, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npu, "hccl_comm_name", lambda group: "hccl_ep")
    assert Mc2Dispatcher(fake_world, 64, device_type="npu").hcom == "hccl_ep"  # an A3 die: built
    fake.npu.name = A2  # an A2 has the ops too
    with pytest.raises(RuntimeError, match=r"^dispatcher=mc2 runs on Atlas A3 \(Ascend910_93xx\) only, this NPU is "
                                           r"Ascend910B3; use dispatcher=fused$"):
        Mc2Dispatcher(fake_world, 64, device_type="npu")


def test_mc2_without_its_package_names_the_extra(fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(FakeTorchNpu, "npu_gmm_alltoallv")  # a torch_npu without the MC2 ops
    with pytest.raises(RuntimeError, match=r"needs torch_npu's MC2 ops .* lacks: pip install '\.\[npu\]'$"):
        npu.check_mc2_chip()
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: the import fails
    with pytest.raises(RuntimeError, match=r"^dispatcher=mc2 needs torch_npu: pip install '\.\[npu\]'"):
        npu.check_mc2_chip()


def _splits(send: list[int], recv: list[int]) -> Splits:
    return Splits(send=send, recv=recv, send_counts_E=send, recv_counts_PG=recv, counts_G=[sum(recv)],
                  recv_counts_dev_PG=torch.tensor(recv)[:, None])


def test_mc2_all_to_all_bytes_outside_the_limits_fail_with_the_numbers() -> None:
    row = 2048 * 2  # Qwen3-30B-A3B: hidden 2048, bf16
    check_bytes(_splits([512] * 8, [512] * 8), row)  # 4096 rows: 16 MiB each way
    # seq 4096 x batch 1 x top-8 = 32768 rows sent: 128 MiB in one all-to-all.
    with pytest.raises(RuntimeError, match=r"^dispatcher=mc2: this rank sends 32768 rows x 4096 bytes = 128\.0 MiB "
                                           r"in one all-to-all, outside MC2's documented 2-100 MiB per rank; .*"
                                           r"use dispatcher=fused$"):
        check_bytes(_splits([4096] * 8, [512] * 8), row)
    with pytest.raises(RuntimeError, match=r"this rank receives 40000 rows x 4096 bytes = 156\.2 MiB"):
        check_bytes(_splits([512] * 8, [5000] * 8), row)  # routing skewed onto this rank's experts
    with pytest.raises(RuntimeError, match=r"this rank sends 64 rows x 4096 bytes = 0\.2 MiB"):
        check_bytes(_splits([8] * 8, [512] * 8), row)


# ----------------------------------------------------------------------------- the dispatch path's kernels

def test_one_expert_per_rank_is_one_matmul(fake: FakeTorchNpu) -> None:
    """torch_npu's grouped matmul rejects a group list of length 1 (one expert per ep rank: the debug model at ep8,
    under fused and mc2): the one GEMM, its input gradient and its weight gradient are plain matmuls, equal to the
    per-expert loop's."""
    torch.manual_seed(0)
    x_Mi, w_1io, grad_Mo = torch.randn(6, 8), torch.randn(1, 8, 4), torch.randn(6, 4)

    def run(fn) -> list[torch.Tensor]:
        x, w = x_Mi.clone().requires_grad_(), w_1io.clone().requires_grad_()
        y = fn(x, w, torch.tensor([6]), [6])
        y.backward(grad_Mo)
        return [y.detach(), x.grad, w.grad]

    for got, want in zip(run(npu_moe.grouped_mm), run(per_group_mm), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same single product
    # MC2's backward computes the weight gradient of its local experts the same way (parallelisms/dispatchers/npu.py).
    torch.testing.assert_close(npu_moe.weight_grad(x_Mi, grad_Mo, torch.tensor([6])), (x_Mi.t() @ grad_Mo)[None])
    two = npu_moe.weight_grad(x_Mi, grad_Mo, torch.tensor([2, 4]))  # two groups: torch_npu's grouped matmul
    torch.testing.assert_close(two, torch.stack([x_Mi[:2].t() @ grad_Mo[:2], x_Mi[2:].t() @ grad_Mo[2:]]))
    assert fake.calls == {"npu_grouped_matmul": 1}


def test_token_permute_gets_int64_indices_and_bf16_tokens(fake: FakeTorchNpu) -> None:
    experts_NK = torch.tensor([[1, 0], [0, 2], [2, 1]])
    x_ND = torch.randn(3, 4, dtype=torch.bfloat16)
    x_MD, row_map_M = npu_moe.moe_token_permute(x_ND, experts_NK)  # the fake asserts int64 indices
    assert torch.equal(x_MD, x_ND[[0, 1, 0, 2, 1, 2]]) and row_map_M.dtype == torch.int32
    with pytest.raises(TypeError, match=r"^torch_npu's npu_moe_token_permute takes bf16 tokens, got torch.float32: "
                                        r"on NPU train with train.mixed_precision=bf16"):
        npu_moe.moe_token_permute(x_ND.float(), experts_NK)
    assert fake.calls == {"npu_moe_token_permute": 1}  # the fp32 call failed before the op


# ----------------------------------------------------------------------------- the fake's own contract

def test_the_fake_rejects_calls_outside_the_documented_contract(fake: FakeTorchNpu) -> None:
    x, w = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(2, 8, 4, dtype=torch.bfloat16)
    gmm = dict(split_item=2, group_type=0, group_list_type=1)
    assert fake.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), **gmm)[0].shape == (6, 4)
    for bad, rule in [
        (dict(x=[x], weight=[w[:1]], group_list=torch.tensor([6])), "group_list of length 2..128, got 1"),
        (dict(x=[x], weight=[w], group_list=torch.tensor([2, 4], dtype=torch.int32)), "1-D int64 tensor"),
        (dict(x=[x], weight=[w.float()], group_list=torch.tensor([2, 4])), "of one dtype"),
        (dict(x=[x], weight=[w], group_list=torch.tensor([2, 3])), "summing to x's rows"),
    ]:
        with pytest.raises(AssertionError, match=rule):
            fake.npu_grouped_matmul(bad["x"], bad["weight"], group_list=bad["group_list"], **gmm)
    with pytest.raises(AssertionError, match="int64 indices, got torch.int32"):
        fake.npu_moe_token_permute(x, torch.zeros(6, 2, dtype=torch.int32))
    with pytest.raises(AssertionError, match="2-D tokens in"):
        fake.npu_moe_token_permute(x.half(), torch.zeros(6, 2, dtype=torch.int64))
    with pytest.raises(AssertionError, match="gamma torch.float32 must be x's dtype"):
        fake.npu_rms_norm(x, torch.ones(8))
    h, w_mc2 = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(1, 8, 4, dtype=torch.bfloat16)
    for ep, counts, rule in [(2, [8, 8], "ep_world_size in"), (8, [2] * 8, r"outside 2097152\.\.104857600")]:
        with pytest.raises(AssertionError, match=rule):
            fake.npu_alltoallv_gmm(h, w_mc2, "hccl_ep", ep, counts, counts)
    with pytest.raises(AssertionError, match=r"one dtype in \(torch.float16, torch.bfloat16\)"):
        fake.npu_alltoallv_gmm(h.float(), w_mc2.float(), "hccl_ep", 8, [2] * 8, [2] * 8)


# ----------------------------------------------------------------------------- selective activation checkpointing

_REAL_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None  # it registers the real npu:: ops
_GMM_CALLS: list[int] = []


def _gmm_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _GMM_CALLS.append(1)
    return x @ w


if not _REAL_TORCH_NPU:
    _NPU_LIB = torch.library.Library("npu", "FRAGMENT")  # stands in for torch_npu's registration of its ops
    _NPU_LIB.define("npu_grouped_matmul(Tensor x, Tensor w) -> Tensor")
    _NPU_LIB.impl("npu_grouped_matmul", _gmm_cpu, "CPU")


class _Gmm(torch.autograd.Function):  # as kernels/moe/npu.py: torch_npu's op has no autograd of its own
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.ops.npu.npu_grouped_matmul(x, w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(_Gmm.apply(torch.sin(x), self.w))


@pytest.mark.skipif(_REAL_TORCH_NPU, reason="the fake npu::npu_grouped_matmul would clash with torch_npu's own")
def test_selective_checkpointing_keeps_torch_npu_matmuls_and_mc2_ops() -> None:
    # Recomputing torch_npu's grouped matmul, or MC2's all-to-all fused with it, in backward would repeat the GEMM
    # or the communication: saved like aten's matmuls and c10d's all-to-all, recomputing only the cheap ops.
    blocks = nn.ModuleList([_Block()])
    apply_activation_checkpointing(blocks, "selective")
    _GMM_CALLS.clear()
    blocks[0](torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert len(_GMM_CALLS) == 1 and blocks[0].w.grad is not None


# ----------------------------------------------------------------------------- core/device.py on a fake NPU

@pytest.fixture
def npu_device(fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device.device_type.cache_clear()
    yield fake
    device.device_type.cache_clear()


def test_device_module_on_an_npu(npu_device: FakeTorchNpu) -> None:
    assert device.device_type("auto") == device.device_type("npu") == "npu"
    assert device.dist_backend("npu") == "hccl"
    device.synchronize("npu")
    device.reset_peak_memory("npu")
    assert (npu_device.npu.synced, npu_device.npu.peak_reset, device.peak_memory_gib("npu")) == (1, 1, 3.0)
    npu_device.npu.available = False
    device.device_type.cache_clear()
    assert device.device_type("auto") == "cpu"
    with pytest.raises(ValueError, match=r"train.device=npu but torch_npu is missing or sees no NPU; "
                                           r"pip install '\.\[npu\]' \(torch-npu of torch's own version, with its "
                                           r"CANN"):
        device.device_type("npu")


@pytest.mark.parametrize("name, tflops", [(A3, 376.0), ("Ascend910_9381", 376.0), ("Ascend910B1", 414.0),
                                          ("Ascend910B2", 376.0), (A2, 313.0), ("Ascend910B4", 280.0),
                                          ("Ascend310P3", None)])
def test_mfu_peak_knows_a2_and_a3(npu_device: FakeTorchNpu, name: str, tflops: float | None) -> None:
    npu_device.npu.name = name
    assert device.peak_tflops("npu") == tflops  # unknown: None (mfu 0), never a guess


def test_torch_npu_of_another_torch_minor_is_refused(npu_device: FakeTorchNpu) -> None:
    major, minor = torch.__version__.split(".")[:2]
    npu_device.__version__ = f"{major}.{int(minor) - 1}.0.post2"
    with pytest.raises(RuntimeError, match=rf"^torch-npu {major}\.{int(minor) - 1}\.0\.post2 is built for torch "
                                           rf"{major}\.{int(minor) - 1}, but torch is .*: pip install '\.\[npu\]'"):
        device.device_type("npu")
    npu_device.__version__ = f"{major}.{minor}.0"
    assert device.module("npu") is npu_device.npu


def test_fla_on_npu_names_triton_ascend_not_the_gpu_extra() -> None:
    with pytest.raises(ImportError, match=r"not installed: pip install 'flash-linear-attention>=0\.6,<0\.7' "
                                          r"triton-ascend") as error:
        select_kernels(KernelConfig(name="auto,flash-linear-attention"), "npu", Env("npu", has_torch_npu=True))
    assert ".[gpu]" not in str(error.value)
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        select_kernels(KernelConfig(name="auto,flash-linear-attention"), "cuda", Env("cuda", capability=(9, 0)))
