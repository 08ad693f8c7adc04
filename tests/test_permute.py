"""The MoE permute / unpermute gathers (``kernels.moe.permute``): against plain indexing + ``models.moe.combine`` on
CPU, which implementation runs where (the registry's, installed per device type), and (on a CUDA machine with
triton) the Triton kernels against the torch code."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kernels.moe.permute as permute
from kernels.config import KernelConfig
from kernels.registry import Choice, Env, installed_kernels, select_kernels
from models.moe import combine

N, K, D = 37, 4, 96
CUDA_TRITON = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _routing(device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    experts_NK = torch.stack([torch.randperm(16, generator=g)[:K] for _ in range(N)])
    order_M = torch.argsort(experts_NK.flatten(), stable=True)
    weights_NK = torch.rand(N, K, generator=g)
    return order_M.to(device), permute.inverse_permutation(order_M).to(device), weights_NK.to(device)


def test_permute_and_unpermute_match_indexing_and_combine() -> None:
    order_M, inv_M, weights_NK = _routing()
    x_ND = torch.randn(N, D, requires_grad=True)
    w_NK = weights_NK.clone().requires_grad_()
    token_M = order_M // K
    y_ND = permute.unpermute(permute.permute_tokens(x_ND, token_M, inv_M) * 2.0, w_NK, order_M, inv_M)
    grads = torch.autograd.grad(y_ND.square().sum(), (x_ND, w_NK))

    x_ref, w_ref = x_ND.detach().clone().requires_grad_(), weights_NK.clone().requires_grad_()
    y_ref = combine(x_ref[token_M] * 2.0, w_ref.flatten()[order_M], token_M, N)
    want = torch.autograd.grad(y_ref.square().sum(), (x_ref, w_ref))
    torch.testing.assert_close(y_ND, y_ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_installed_kernels_run_only_for_their_device_type() -> None:
    """A run installs the registry's choice for its device type; tensors on another device keep the torch code."""
    order_M, inv_M, weights_NK = _routing()
    src_MD, grad_ND = torch.randn(N * K, D), torch.randn(N, D)
    calls = []

    def recording(op: str):  # a stand-in for a Triton kernel (which needs CUDA tensors): the torch code, counted
        reference = getattr(permute, f"{op}_torch")
        return lambda *args: calls.append(op) or reference(*args)

    kernels = select_kernels(KernelConfig(), "cpu", Env("cpu"))
    for op in ("gather_sum", "unpermute_backward"):
        kernels.choices[op] = Choice(op, "recording", "test", lambda op=op: recording(op))

    def forward_backward(permutation: bool = True) -> tuple[torch.Tensor, ...]:
        y_MD, w_NK = src_MD.clone().requires_grad_(), weights_NK.clone().requires_grad_()
        y_ND = permute.unpermute(y_MD, w_NK, order_M, inv_M, permutation)
        y_ND.backward(grad_ND)
        return y_ND.detach(), y_MD.grad, w_NK.grad

    with installed_kernels():  # none: the torch references
        want = forward_backward()
    with installed_kernels(kernels, "cuda"):
        forward_backward()
    assert calls == []
    with installed_kernels(kernels):  # for CPU tensors, the device the choice was made for
        got = forward_backward()
        assert calls == ["gather_sum", "unpermute_backward"]
        forward_backward(permutation=False)  # dedup's pre-reduction keeps its torch backward
        assert calls == ["gather_sum", "unpermute_backward", "gather_sum"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_torch_code(dtype: torch.dtype) -> None:
    from kernels.moe import triton_permute

    order_M, inv_M, weights_NK = _routing("cuda")
    src_MD = torch.randn(N * K, D, device="cuda").to(dtype)
    grad_ND = torch.randn(N, D, device="cuda").to(dtype)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for weights in (None, weights_NK):
        torch.testing.assert_close(triton_permute.gather_sum(src_MD, inv_M, N, K, weights),
                                   permute.gather_sum_torch(src_MD, inv_M, N, K, weights), **tol)
    y_MD, w_NK = src_MD.clone().requires_grad_(), weights_NK.clone().requires_grad_()
    with installed_kernels():  # nothing installed: the torch code on the same tensors
        permute.unpermute(y_MD, w_NK, order_M, inv_M).backward(grad_ND)
    grad_y, grad_w = triton_permute.unpermute_backward(grad_ND, src_MD, weights_NK, order_M, inv_M)
    torch.testing.assert_close(grad_y, y_MD.grad, **tol)
    torch.testing.assert_close(grad_w, w_NK.grad, rtol=2e-2, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)


def _collective_results_worker(rank: int, world_size: int) -> list[bool]:
    """What ``_materialised`` gives for an all-to-all's result, a view of it, and ``.to()`` its own dtype
    (the weights of the dedup dispatcher): each must be a plain tensor with the received values."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single

    sent = torch.arange(4, dtype=torch.float32).view(2, 2) + 10 * rank
    got = all_to_all_single(sent, None, None, dist.group.WORLD)
    want = torch.tensor([[0.0, 1.0], [10.0, 11.0]]) if rank == 0 else torch.tensor([[2.0, 3.0], [12.0, 13.0]])
    checks = []
    for t in (got, got.flatten(), got.to(torch.float32)):
        plain = permute._materialised(t)
        checks += [isinstance(t, AsyncCollectiveTensor), type(plain) is torch.Tensor,
                   torch.equal(plain.view(2, 2), want)]
    return checks


def test_collective_results_reach_triton_as_plain_tensors() -> None:
    from tests.dist_utils import run_distributed

    checks = run_distributed(_collective_results_worker, 2)
    # all three arrive as AsyncCollectiveTensors (views and same-dtype .to() stay wrapped) and leave plain
    assert checks == [True, True, True] * 3, checks


def test_the_local_dispatcher_runs_the_installed_gathers_and_matches_index_add() -> None:
    """The single-rank MoE path (``LocalDispatcher``) moves tokens with the registry's K-to-one kernels (on CUDA:
    Triton's; counted here through a recording stand-in on CPU) and gives what sorting + ``index_add_`` combining
    gives, forward and every gradient."""
    from models.moe import ExpertWeights, LocalDispatcher, compute_experts, sort_by_expert

    g = torch.Generator().manual_seed(1)
    E, I = 16, 24
    experts_NK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    leaves = [torch.randn(N, D, generator=g), torch.rand(N, K, generator=g),
              torch.randn(E, 2 * I, D, generator=g) / 8, torch.randn(E, D, I, generator=g) / 8]

    def act(gate_up_M2I: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_M2I.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def run(dispatch) -> list[torch.Tensor]:
        x_ND, w_NK, gate_up, down = (t.clone().requires_grad_() for t in leaves)
        y_ND = dispatch(ExpertWeights(gate_up, down, act), x_ND, experts_NK, w_NK)
        return [y_ND, *torch.autograd.grad(y_ND.square().sum(), (x_ND, w_NK, gate_up, down))]

    def index_add_reference(experts, x_ND, experts_NK, weights_NK):
        order_M, counts_E = sort_by_expert(experts_NK, E)
        token_M = order_M // K
        return combine(compute_experts(experts, x_ND[token_M], counts_E), weights_NK.flatten()[order_M], token_M, N)

    calls = []
    kernels = select_kernels(KernelConfig(), "cpu", Env("cpu"))
    for op in ("gather_sum", "unpermute_backward"):
        reference = getattr(permute, f"{op}_torch")
        kernels.choices[op] = Choice(op, "recording", "test",
                                     lambda op=op, ref=reference: lambda *a: calls.append(op) or ref(*a))
    with installed_kernels(kernels):
        got = run(LocalDispatcher())
    # forward: the unpermute's gather_sum; backward: its unpermute_backward, then the permute's gather_sum
    assert calls == ["gather_sum", "unpermute_backward", "gather_sum"]
    for a, b in zip(got, run(index_add_reference), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
