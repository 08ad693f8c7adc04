"""The chunked LM head + cross-entropy against ``F.cross_entropy(h @ w.T)``: loss and both gradients, ragged
last chunk, ignored rows, no-grad mode, autocast, and through the model (with and without FSDP hooks: the
layout tests in test_parallel_parity.py train through it); the head over the trained rows only against the head
over every row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.constants import IGNORE_INDEX
from kernels.loss.linear_cross_entropy import default_chunk_rows, linear_cross_entropy_sum, softmax_cross_entropy_
from models.causal_lm import LMHead, trained_rows
from tests.test_attention import FAMILIES, packed_inputs, tiny_model

CPU = torch.device("cpu")


def _inputs(rows: int = 37, dim: int = 16, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h_ND = torch.randn(rows, dim, generator=g, requires_grad=True)
    w_VD = torch.randn(vocab, dim, generator=g, requires_grad=True)
    labels_N = torch.randint(0, vocab, (rows,), generator=g)
    labels_N[[0, 3, 20, rows - 1]] = IGNORE_INDEX
    return h_ND, w_VD, labels_N


def _reference(h_ND, w_VD, labels_N, scale: float):
    loss = F.cross_entropy(h_ND @ w_VD.t(), labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    grad_h, grad_w = torch.autograd.grad(loss * scale, (h_ND, w_VD))
    return loss.detach(), grad_h, grad_w


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 1000])  # one row, ragged last chunk, exact, one chunk
def test_matches_cross_entropy_of_the_logits(chunk_rows: int) -> None:
    h_ND, w_VD, labels_N = _inputs()
    want_loss, want_h, want_w = _reference(h_ND, w_VD, labels_N, scale=0.37)
    loss = linear_cross_entropy_sum(h_ND, w_VD, labels_N, chunk_rows=chunk_rows)
    grad_h, grad_w = torch.autograd.grad(loss * 0.37, (h_ND, w_VD))
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grad_h, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_w, want_w, rtol=1e-5, atol=1e-6)
    assert grad_h[[0, 3, 20, 36]].abs().max() == 0  # ignored rows get no gradient


def test_all_rows_ignored_gives_zero_loss_and_gradients() -> None:
    h_ND, w_VD, labels_N = _inputs(rows=24)
    loss = linear_cross_entropy_sum(h_ND, w_VD, torch.full_like(labels_N, IGNORE_INDEX), chunk_rows=2)
    grad_h, grad_w = torch.autograd.grad(loss, (h_ND, w_VD))
    assert loss.item() == 0 and grad_h.abs().max() == 0 and grad_w.abs().max() == 0


def test_only_the_needed_gradients_are_built() -> None:
    h_ND, w_VD, labels_N = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h_ND, w_VD, labels_N)
    assert loss.grad_fn is None
    frozen_w = w_VD.detach()
    (grad_h,) = torch.autograd.grad(linear_cross_entropy_sum(h_ND, frozen_w, labels_N, chunk_rows=8), (h_ND,))
    torch.testing.assert_close(grad_h, _reference(h_ND, w_VD, labels_N, 1.0)[1], rtol=1e-5, atol=1e-6)


def test_autocast_runs_the_matmuls_in_the_autocast_dtype() -> None:
    h_ND, w_VD, labels_N = _inputs(rows=32, dim=32, vocab=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(h_ND, w_VD, labels_N, chunk_rows=8)
        want = F.cross_entropy(F.linear(h_ND, w_VD).float(), labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-4)  # same bf16 logits, fp32 softmax
    grad_h, grad_w = torch.autograd.grad(loss, (h_ND, w_VD))
    assert grad_h.dtype == grad_w.dtype == torch.float32  # autograd casts back to the leaves' dtype
    with pytest.raises(TypeError, match="LM head weight"):
        linear_cross_entropy_sum(h_ND.bfloat16(), w_VD, labels_N)


def test_chunk_is_a_gibibyte_of_bf16_logits() -> None:
    assert default_chunk_rows(151_936) == 3533
    assert default_chunk_rows(1 << 30) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_step_writes_the_logit_gradient_in_place(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits_CV = (torch.randn(6, 40, generator=g) * 3).to(dtype)
    labels_C = torch.tensor([3, IGNORE_INDEX, 0, 39, 7, 7])
    leaf = logits_CV.float().requires_grad_()
    want = F.cross_entropy(leaf, labels_C, ignore_index=IGNORE_INDEX, reduction="none")
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    buffer = logits_CV.clone()
    loss_C = softmax_cross_entropy_(buffer, labels_C)
    assert loss_C.dtype == torch.float32
    torch.testing.assert_close(loss_C, want.detach(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(buffer, want_grad.to(dtype), rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)


def test_lm_head_ce_is_a_kernel_slot_with_triton_on_cuda_only() -> None:
    from kernels.config import KernelConfig
    from kernels.registry import Env, select_kernels

    cuda = select_kernels(KernelConfig(), "cuda", Env("cuda", triton_version="3.6.0", capability=(9, 0)))
    assert cuda.choices["softmax_cross_entropy"].impl == "triton"
    for env in (Env("cpu"), Env("npu", has_torch_npu=True), Env("cuda", capability=(9, 0))):  # last: no triton
        assert select_kernels(KernelConfig(), env.device_type, env).choices["softmax_cross_entropy"].impl == "torch"


def test_model_loss_sum_equals_cross_entropy_of_its_logits() -> None:
    from models import get_spec
    from tests.conftest import compose_config

    cfg = compose_config([])
    spec = get_spec("qwen3_moe")
    torch.manual_seed(0)
    model = spec.model_cls(spec.args_cls(**cfg.model.arch))
    model.init_weights()
    input_ids_BT = torch.randint(0, 1000, (2, 16))
    labels_BT = torch.randint(0, 1000, (2, 16))
    labels_BT[0, :3] = IGNORE_INDEX
    logits_BTV = model(input_ids_BT).logits
    want = F.cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    out = model(input_ids_BT, labels_BT=labels_BT)
    assert out.logits is None
    torch.testing.assert_close(out.loss_sum, want, rtol=1e-5, atol=1e-4)


def _head_loss_and_grads(head: LMHead, h_BTD: torch.Tensor, labels_BT: torch.Tensor,
                         rows_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = head(h_BTD, labels_BT, rows_N)
    grad_h, grad_w = torch.autograd.grad(loss * 0.37, (h_BTD, head.weight))
    return loss.detach(), grad_h, grad_w


def test_lm_head_on_the_trained_rows_only_matches_every_row_and_cross_entropy() -> None:
    torch.manual_seed(0)
    head = LMHead(16, 50)
    h_BTD = torch.randn(3, 12, 16, requires_grad=True)
    labels_BT = torch.randint(0, 50, (3, 12))
    labels_BT[torch.rand(3, 12) < 0.5] = IGNORE_INDEX
    rows_N = trained_rows(labels_BT, CPU)
    assert 0 < rows_N.numel() < labels_BT.numel()
    want_loss, want_h, want_w = _reference(h_BTD.flatten(0, 1), head.weight, labels_BT.flatten(), scale=0.37)
    for got_loss, got_h, got_w in (_head_loss_and_grads(head, h_BTD, labels_BT, rows_N),
                                   _head_loss_and_grads(head, h_BTD, labels_BT, None)):
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got_h.flatten(0, 1), want_h, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_lm_head_on_no_trained_rows_gives_zero_loss_and_gradients() -> None:
    head = LMHead(16, 50)
    h_BTD = torch.randn(2, 5, 16, requires_grad=True)
    labels_BT = torch.full((2, 5), IGNORE_INDEX)
    rows_N = trained_rows(labels_BT, CPU)
    assert rows_N.shape == (0,)
    loss, grad_h, grad_w = _head_loss_and_grads(head, h_BTD, labels_BT, rows_N)
    assert loss.item() == 0 and grad_h.abs().max() == 0 and grad_w.abs().max() == 0


def test_trained_rows_are_none_when_every_label_is_trained_else_their_flat_indices() -> None:
    assert trained_rows(torch.randint(0, 50, (2, 6)), CPU) is None
    rows_N = trained_rows(torch.tensor([[5, IGNORE_INDEX, 7], [IGNORE_INDEX, IGNORE_INDEX, 0]]), CPU)
    assert rows_N.dtype == torch.int64 and rows_N.tolist() == [0, 2, 5]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_trains_the_same_on_the_trained_rows_only(family: str) -> None:
    """Padding and an untrained prompt (``packed_inputs``): loss and every gradient as with the head on every row."""
    input_ids_BT, position_ids_BT, labels_BT = packed_inputs()
    rows_N = trained_rows(labels_BT, CPU)
    assert rows_N is not None
    results = []
    for rows in (None, rows_N):
        model = tiny_model(family)
        loss = model(input_ids_BT, position_ids_BT, labels_BT, trained_rows=rows).loss_sum
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters())])
    every, trained = results
    assert len(every) == len(trained)
    for want, got in zip(every, trained):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and triton)")
def test_triton_step_matches_the_reference_on_cuda() -> None:
    from kernels.loss.triton_cross_entropy import softmax_cross_entropy_ as triton_step

    g = torch.Generator(device="cuda").manual_seed(0)
    logits_CV = (torch.randn(300, 5000, generator=g, device="cuda") * 4).bfloat16()
    labels_C = torch.randint(0, 5000, (300,), generator=g, device="cuda")
    labels_C[::7] = IGNORE_INDEX
    got, want = logits_CV.clone(), logits_CV.clone()
    torch.testing.assert_close(triton_step(got, labels_C), softmax_cross_entropy_(want, labels_C),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=0, atol=4e-3)  # one bf16 rounding of the same fp32 values


@pytest.mark.parametrize("family", FAMILIES)
def test_validation_loss_on_masked_labels_is_the_mean_cross_entropy_of_the_logits(family: str) -> None:
    """validation_loss (the head over the trained rows only) against F.cross_entropy of the full logits."""
    from training.evaluate import validation_loss

    input_ids_BT, position_ids_BT, labels_BT = packed_inputs()
    model = tiny_model(family)
    with torch.no_grad():
        logits_BTV = model(input_ids_BT, position_ids_BT).logits
    want = F.cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE_INDEX)
    batch = {"input_ids": input_ids_BT, "position_ids": position_ids_BT, "labels": labels_BT}
    got = validation_loss(model, [batch], CPU, torch.autocast("cpu", enabled=False), None)
    assert got == pytest.approx(want.item(), rel=1e-5)
