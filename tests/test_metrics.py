"""MoE observability: imbalance and router entropy computed from the routing statistics."""

from __future__ import annotations

import math

import pytest
import torch

from models.moe import TopKRouter
from training.metrics import moe_metrics, progress_line, routing_summary


def test_imbalance_and_entropy_match_a_direct_computation():
    torch.manual_seed(0)
    router = TopKRouter(dim=16, num_experts=4, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    x_ND = torch.randn(50, 16)
    _, experts_NK, stats = router(x_ND)
    metrics = moe_metrics(routing_summary([stats, stats]), group=None)
    counts = torch.bincount(experts_NK.flatten(), minlength=4).float()
    probs = torch.softmax(x_ND @ router.weight.T, dim=-1)
    entropy = -(probs * probs.log()).sum(-1).mean()
    assert metrics["moe/layer1/imbalance"] == pytest.approx((counts.max() / counts.mean()).item())
    assert metrics["moe/layer0/router_entropy"] == pytest.approx(entropy.item(), rel=1e-5)
    assert 0 < metrics["moe/layer0/router_entropy"] <= math.log(4)
    assert metrics["moe/max_imbalance"] == metrics["moe/layer0/imbalance"]
    # One layer's aux loss is transformers' load_balancing_loss_func over that layer's tokens.
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    want = load_balancing_loss_func((x_ND @ router.weight.T,), num_experts=4, top_k=2)
    assert metrics["moe/layer0/aux_loss"] == pytest.approx(want.item(), rel=1e-5)


def test_progress_line_is_one_concise_line():
    m = {"step": 3, "loss": 2.5, "aux_loss": 1.0, "grad_norm": 0.5, "lr": 1e-3, "tokens_per_s_per_device": 1234.0,
         "mfu": 0.41, "moe/max_imbalance": 1.7, "peak_mem_gib": 3.2}
    line = progress_line(m, 10, eta_s=75)
    assert "\n" not in line and "step     3/10" in line and "mfu 41.0%" in line and "eta 1m15s" in line
