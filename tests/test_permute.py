"""The MoE permute / unpermute gathers (``kernels.permute``): against plain indexing + ``models.moe.combine`` on
CPU, which path runs where, and (on a CUDA machine with triton) the Triton kernels against the torch code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kernels.permute as permute
from models.moe import combine

N, K, D = 37, 4, 96
CUDA_TRITON = torch.cuda.is_available() and permute._have_triton()


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


def test_triton_runs_only_for_cuda_tensors_with_triton_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_like = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(permute, "_have_triton", lambda: True)
    assert permute.use_triton(cuda_like) and not permute.use_triton(torch.zeros(1))
    monkeypatch.setattr(permute, "_have_triton", lambda: False)
    assert not permute.use_triton(cuda_like)


@pytest.mark.skipif(not CUDA_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_match_the_torch_code(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import triton_permute

    order_M, inv_M, weights_NK = _routing("cuda")
    src_MD = torch.randn(N * K, D, device="cuda").to(dtype)
    grad_ND = torch.randn(N, D, device="cuda").to(dtype)
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(permute, "_have_triton", lambda: False)  # the torch code on the same tensors
    for weights in (None, weights_NK):
        torch.testing.assert_close(triton_permute.gather_sum(src_MD, inv_M, N, K, weights),
                                   permute.gather_sum(src_MD, inv_M, N, K, weights), **tol)
    y_MD, w_NK = src_MD.clone().requires_grad_(), weights_NK.clone().requires_grad_()
    permute.unpermute(y_MD, w_NK, order_M, inv_M).backward(grad_ND)
    grad_y, grad_w = triton_permute.unpermute_backward(grad_ND, src_MD, weights_NK, inv_M)
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
