"""A fake torch_npu for CPU tests: the ops this repository calls, as torch_npu's documentation describes them (torch_npu
2.x op schemas, the Ascend op-plugin docs), in plain torch, each checking its documented contract first (shapes,
dtypes, index types, MC2's limits), so a call outside the contract fails here (AssertionError naming the rule) as it
would on the device. ``calls`` counts the ops. ``npu`` stands in for ``torch_npu.npu`` (the device module).

The glue tests (dispatchers and kernels against their torch references) run a relaxed contract, ``GLUE``: fp32, so the
comparison is exact, and ep2 with tiny rows, so 2 CPU ranks suffice; ``DOCUMENTED`` is what the device enforces, and
tests/test_npu_contract.py checks our code against it.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._C._distributed_c10d import _resolve_process_group

from kernels.tokenwise.rotary import rotate_half

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
HALVES = (torch.float16, torch.bfloat16)
MiB = 2**20
A3 = "Ascend910_9392"  # torch_npu.npu.get_device_name() on an Atlas A3 die
A2 = "Ascend910B3"


@dataclass(frozen=True)
class Contract:
    permute_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)  # npu_moe_token_permute's tokens
    gmm_dtypes: tuple[torch.dtype, ...] = FLOATS  # npu_grouped_matmul (A2 / A3)
    gmm_groups: tuple[int, int] = (2, 128)  # the length of group_list: a single group is rejected
    mc2_dtypes: tuple[torch.dtype, ...] = HALVES
    mc2_ep_sizes: tuple[int, ...] = (8, 16, 32, 64)
    mc2_max_local_experts: int = 32
    mc2_max_experts: int = 256  # e * ep_world_size, the length of the count lists
    mc2_bytes: tuple[int, int] = (2 * MiB, 100 * MiB)  # per rank, each all-to-all


DOCUMENTED = Contract()
GLUE = dataclasses.replace(DOCUMENTED, permute_dtypes=FLOATS, mc2_dtypes=FLOATS, mc2_ep_sizes=(2, 4, 8, 16, 32, 64),
                           mc2_bytes=(0, 100 * MiB))


def _require(ok: bool, rule: str) -> None:
    assert ok, f"torch_npu contract: {rule}"


class FakeNpuDevice(types.SimpleNamespace):
    """``torch_npu.npu`` (which torch_npu also registers as ``torch.npu``): what core/device.py calls."""

    def __init__(self, name: str, available: bool = True) -> None:
        super().__init__(name=name, available=available, current=None, synced=0, peak_reset=0)

    def is_available(self) -> bool:
        return self.available

    def get_device_name(self, device=None) -> str:
        return self.name

    def set_device(self, index: int) -> None:
        self.current = index

    def synchronize(self) -> None:
        self.synced += 1

    def reset_peak_memory_stats(self) -> None:
        self.peak_reset += 1

    def max_memory_allocated(self) -> int:
        return 3 * 2**30


class FakeTorchNpu(types.ModuleType):
    def __init__(self, contract: Contract = DOCUMENTED, device_name: str = A3, version: str = torch.__version__):
        super().__init__("torch_npu")
        self.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
        self.__version__ = version
        self.contract = contract
        self.npu = FakeNpuDevice(device_name)
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    # --- the models' kernel slots (kernels/tokenwise/npu.py)

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
        self._count("npu_rms_norm")
        _require(x.dtype in FLOATS and gamma.dtype == x.dtype, f"npu_rms_norm: gamma {gamma.dtype} must be x's dtype "
                                                               f"{x.dtype} (fp16, bf16 or fp32)")
        _require(tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]), "npu_rms_norm: gamma is x's last dims")
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def npu_swiglu(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._count("npu_swiglu")
        _require(x.dtype in FLOATS and x.shape[dim] % 2 == 0, "npu_swiglu: an even size along dim, fp16/bf16/fp32")
        gate, up = x.chunk(2, dim=dim)
        return F.silu(gate) * up

    def npu_rotary_mul(self, x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        self._count("npu_rotary_mul")
        _require(x.dim() == r1.dim() == r2.dim() == 4 and x.dtype == r1.dtype == r2.dtype,
                 "npu_rotary_mul: 4-D x, r1, r2 of one dtype")
        _require(r1.shape == r2.shape and r1.shape[-1] == x.shape[-1], "npu_rotary_mul: r1, r2 alike, x's last dim")
        return r1 * x + r2 * rotate_half(x)

    # --- the dispatch path (kernels/moe/npu.py)

    def npu_moe_token_permute(self, tokens: torch.Tensor, indices: torch.Tensor):
        self._count("npu_moe_token_permute")
        _require(tokens.dim() == 2 and tokens.dtype in self.contract.permute_dtypes,
                 f"npu_moe_token_permute: 2-D tokens in {self.contract.permute_dtypes}, got {tokens.dtype}")
        _require(indices.dtype == torch.int64, f"npu_moe_token_permute: int64 indices, got {indices.dtype}")
        _require(indices.dim() == 2 and indices.shape[0] == tokens.shape[0], "npu_moe_token_permute: indices [N, K]")
        order = torch.argsort(indices.flatten(), stable=True)
        return tokens[order // indices.shape[1]], torch.argsort(order).to(torch.int32)

    def npu_moe_token_unpermute(self, permuted: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor):
        self._count("npu_moe_token_unpermute")
        _require(permuted.dtype == probs.dtype, f"npu_moe_token_unpermute: permuted {permuted.dtype} and probs "
                                                f"{probs.dtype} of one dtype")
        _require(sorted_indices.dtype == torch.int32, "npu_moe_token_unpermute: int32 sorted_indices")
        _require(permuted.shape[0] == sorted_indices.numel() == probs.numel(),
                 "npu_moe_token_unpermute: one permuted row per (token, k)")
        rows = permuted[sorted_indices.long()].view(*probs.shape, permuted.shape[-1])
        return (rows * probs.unsqueeze(-1)).sum(1)

    def npu_grouped_matmul(self, x: list, weight: list, *, group_list: torch.Tensor, split_item: int,
                           group_type: int, group_list_type: int) -> list[torch.Tensor]:
        self._count("npu_grouped_matmul")
        low, high = self.contract.gmm_groups
        _require(len(x) == len(weight) == 1, "npu_grouped_matmul: one x and one weight (single-tensor mode)")
        x_, w = x[0], weight[0]
        _require(x_.dtype == w.dtype and x_.dtype in self.contract.gmm_dtypes,
                 f"npu_grouped_matmul: x {x_.dtype} and weight {w.dtype} of one dtype, fp16/bf16/fp32")
        _require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1,
                 "npu_grouped_matmul: group_list a 1-D int64 tensor")
        _require(low <= len(group_list) <= high, f"npu_grouped_matmul: group_list of length {low}..{high}, got "
                                                 f"{len(group_list)}")
        _require(group_list_type == 1, "npu_grouped_matmul: group_list_type 1 (counts) is what we pass")
        counts = group_list.tolist()
        if group_type == 0:  # the rows of x grouped: [M, K] x [G, K, N] -> [M, N]
            _require(split_item == 2 and x_.dim() == 2 and w.dim() == 3, "npu_grouped_matmul group_type 0: split_item "
                                                                         "2, x [M, K], weight [G, K, N]")
            _require(w.shape[0] == len(counts) and w.shape[1] == x_.shape[1] and sum(counts) == x_.shape[0],
                     "npu_grouped_matmul group_type 0: one count per weight, summing to x's rows")
            # Ours, not torch_npu's: kernels/moe/npu.py leaves an expert without rows to the per-expert loop.
            _require(0 not in counts, "kernels/moe/npu.py sends no empty group")
            return [torch.cat([c @ w[g] for g, c in enumerate(x_.split(counts))])]
        # The contraction dim grouped: [K, M] x [M, N] -> [G, K, N].
        _require(group_type == 2 and split_item == 3 and x_.dim() == w.dim() == 2 and sum(counts) == x_.shape[1]
                 == w.shape[0], "npu_grouped_matmul group_type 2: split_item 3, x [K, M], weight [M, N], counts "
                                "summing to M")
        return [torch.stack([a @ b for a, b in zip(x_.split(counts, dim=1), w.split(counts))])]

    # --- MC2 (parallelisms/dispatchers/npu.py). Each finds its group by the name npu.hccl_comm_name gave (the tests
    # patch it to the group's name) in c10d's process-wide registry, as HCCL finds its communicator by name: any
    # group of any mesh, also one built after the fake (on a machine with CUDA, init_device_mesh gives a gloo mesh's
    # world-sized dimension a new group, named '4' and up, where a CPU-only machine reuses the default group '0').

    def _check_mc2(self, op: str, gmm_x: torch.Tensor, gmm_weight: torch.Tensor, hcom: str, ep: int,
                   send_counts: list[int], recv_counts: list[int], trans_gmm_weight: bool) -> None:
        c = self.contract
        _require(gmm_x.dim() == 2 and gmm_weight.dim() == 3 and gmm_x.dtype == gmm_weight.dtype
                 and gmm_x.dtype in c.mc2_dtypes, f"{op}: 2-D gmm_x, 3-D gmm_weight, one dtype in {c.mc2_dtypes}")
        _require(0 < len(hcom) < 128, f"{op}: hcom of 1..127 characters")
        _require(ep in c.mc2_ep_sizes, f"{op}: ep_world_size in {c.mc2_ep_sizes}, got {ep}")
        e = gmm_weight.shape[0]
        _require(e <= c.mc2_max_local_experts and e * ep <= c.mc2_max_experts,
                 f"{op}: at most {c.mc2_max_local_experts} local and {c.mc2_max_experts} experts, got {e} x {ep}")
        _require(len(send_counts) == len(recv_counts) == e * ep, f"{op}: send/recv counts of length e * ep_world_size")
        _require(sum(send_counts) == gmm_x.shape[0], f"{op}: send_counts summing to gmm_x's rows")
        _require(gmm_weight.shape[2 if trans_gmm_weight else 1] == gmm_x.shape[1], f"{op}: gmm_weight's in-features")

    def _check_mc2_bytes(self, op: str, rows: int, y: torch.Tensor) -> None:
        low, high = self.contract.mc2_bytes
        size = rows * y.shape[1] * y.element_size()
        _require(low <= size <= high, f"{op}: {size} bytes in one all-to-all, outside {low}..{high} per rank")

    @staticmethod
    def _a2a(x: torch.Tensor, send: list[int], recv: list[int], hcom: str) -> torch.Tensor:
        out = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=_resolve_process_group(hcom))
        return out

    @staticmethod
    def _layout(counts: list[int], ep: int):
        """Counts per (rank, local expert) -> per rank, per local expert, and the arrival -> expert row order."""
        c = torch.tensor(counts).view(ep, len(counts) // ep)
        expert = torch.arange(c.shape[1]).repeat(ep).repeat_interleave(c.flatten())
        return c.sum(1).tolist(), c.sum(0).tolist(), torch.argsort(expert, stable=True)

    @staticmethod
    def _gmm(x_MK: torch.Tensor, w_GKN: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = [c @ w_GKN[g] for g, c in enumerate(x_MK.split(counts))]
        return torch.cat(outs) if outs else x_MK.new_zeros(0, w_GKN.shape[2])

    def npu_alltoallv_gmm(self, gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
                          trans_gmm_weight=False, permute_out_flag=False):
        self._count("npu_alltoallv_gmm")
        self._check_mc2("npu_alltoallv_gmm", gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts,
                        trans_gmm_weight)
        send, _, _ = self._layout(send_counts, ep_world_size)
        recv, counts_L, by_expert = self._layout(recv_counts, ep_world_size)
        self._check_mc2_bytes("npu_alltoallv_gmm", max(sum(send), sum(recv)), gmm_x)
        permuted = self._a2a(gmm_x, send, recv, hcom)[by_expert]
        w = gmm_weight.transpose(1, 2) if trans_gmm_weight else gmm_weight
        return self._gmm(permuted, w, counts_L), None, permuted if permute_out_flag else None

    def npu_gmm_alltoallv(self, gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts, *,
                          trans_gmm_weight=False):
        self._count("npu_gmm_alltoallv")
        self._check_mc2("npu_gmm_alltoallv", gmm_x, gmm_weight, hcom, ep_world_size, send_counts, recv_counts,
                        trans_gmm_weight)
        send, counts_L, by_expert = self._layout(send_counts, ep_world_size)
        recv, _, _ = self._layout(recv_counts, ep_world_size)
        y = self._gmm(gmm_x, gmm_weight.transpose(1, 2) if trans_gmm_weight else gmm_weight, counts_L)
        self._check_mc2_bytes("npu_gmm_alltoallv", max(sum(send), sum(recv)), y)
        return self._a2a(torch.empty_like(y).index_copy(0, by_expert, y), send, recv, hcom), None


def install(fake: FakeTorchNpu, monkeypatch: pytest.MonkeyPatch | None = None) -> FakeTorchNpu:
    """Make ``import torch_npu`` give ``fake`` and ``torch.npu`` its device module, as the real import does; with
    ``monkeypatch`` undone after the test (without: for the rest of a spawned rank). kernels.tokenwise.npu, which
    imports torch_npu at its own import, is imported anew against the fake."""
    if monkeypatch:
        monkeypatch.setitem(sys.modules, "torch_npu", fake)
        monkeypatch.setattr(torch, "npu", fake.npu, raising=False)
        monkeypatch.delitem(sys.modules, "kernels.tokenwise.npu", raising=False)
    else:
        sys.modules["torch_npu"] = fake
        torch.npu = fake.npu
        sys.modules.pop("kernels.tokenwise.npu", None)
    return fake
