"""Our Qwen3-MoE against transformers' Qwen3MoeForCausalLM in fp32 on CPU: logits, loss with the router
aux loss, and every parameter gradient. Also the grouped-GEMM expert path against the per-group loop."""

from __future__ import annotations

import pytest
import torch
import transformers

import models.moe
from kernels.moe.grouped_mm import native_grouped_mm, native_grouped_mm_ok, per_group_mm
from models import build_args, get_spec
from models.moe import GroupedExperts
from tests.conftest import our_loss_like_transformers
from training.loss import router_loss_shares

pytestmark = pytest.mark.torch_apis  # torch._grouped_mm

ARCH = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
            rope_theta=10000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.01, max_position_embeddings=256,
            initializer_range=0.1)  # larger than 0.02 so attention and routing are far from uniform


def _models(experts_implementation: str | None, **arch) -> tuple[torch.nn.Module, torch.nn.Module]:
    arch = {**ARCH, **arch}
    args = build_args("qwen3_moe", arch)
    torch.manual_seed(0)
    ours = get_spec("qwen3_moe").model_cls(args)
    ours.init_weights()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    config = transformers.Qwen3MoeConfig(**arch, output_router_logits=True)
    assert config.norm_topk_prob == args.norm_topk_prob
    hf = transformers.Qwen3MoeForCausalLM(config).float()
    hf.load_state_dict(ours.state_dict(), strict=True)  # the same parameter names, by design
    if experts_implementation is not None:
        hf.set_experts_implementation(experts_implementation)
    return ours, hf


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# None: transformers' default (grouped_mm). norm_topk_prob=False (transformers' config default; the hub's Qwen3-MoE
# checkpoints set true): the top-k weights stay softmax probabilities, summing to less than 1.
@pytest.mark.parametrize("experts_implementation, norm_topk_prob", [("eager", True), (None, True), (None, False)])
def test_forward_loss_and_grads_match_transformers(experts_implementation: str | None, norm_topk_prob: bool) -> None:
    """Logits, aux loss, loss and every parameter gradient against transformers' Qwen3MoeForCausalLM (fp32)."""
    ours, hf = _models(experts_implementation, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(1)
    input_ids_BT = torch.randint(0, ARCH["vocab_size"], (2, 24))
    with torch.no_grad():
        logits = ours(input_ids_BT).logits
    loss, out = our_loss_like_transformers(ours, input_ids_BT, ARCH["num_experts"], ARCH["router_aux_loss_coef"])
    aux = router_loss_shares(out.router_stats, ARCH["num_experts"])[0]
    loss.backward()
    ref = hf(input_ids=input_ids_BT, labels=input_ids_BT)
    ref.loss.backward()

    # 1e-5: fp32 round-off of two orderings of the same ops over a 2-layer model.
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(aux, ref.aux_loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=0, atol=1e-5)
    hf_params = dict(hf.named_parameters())
    assert set(hf_params) == {name for name, _ in ours.named_parameters()}
    errors = {name: _rel_err(p.grad, hf_params[name].grad) for name, p in ours.named_parameters()}
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_grouped_mm_matches_per_group_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    E, D, I, N, K = 4, 16, 8, 10, 2
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, I)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    assert native_grouped_mm_ok(torch.empty(1, D), experts.gate_up_proj.transpose(-2, -1)), \
        "torch._grouped_mm should run on CPU fp32 (torch >= 2.13): this test would compare the loop with itself"
    x_ND = torch.randn(N, D)
    # Two distinct experts per token from {0, 1, 3}: expert 2 gets no tokens.
    experts_NK = torch.stack([torch.tensor([0, 1, 3])[torch.randperm(3)[:K]] for _ in range(N)])
    weights_NK = torch.rand(N, K)
    grad_ND = torch.randn(N, D)

    def run() -> tuple[torch.Tensor, ...]:
        experts.zero_grad()
        x = x_ND.clone().requires_grad_()
        y_ND = experts(x, experts_NK, weights_NK)
        (y_ND * grad_ND).sum().backward()
        return y_ND.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()

    monkeypatch.setattr(models.moe, "grouped_mm", native_grouped_mm)  # the registry's CUDA choice (CPU: the loop)
    grouped = run()
    monkeypatch.setattr(models.moe, "grouped_mm", per_group_mm)
    loop = run()
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b)  # fp32 defaults: only the accumulation order differs
    assert grouped[2][2].abs().sum() == 0 and grouped[3][2].abs().sum() == 0  # the idle expert gets no grad
