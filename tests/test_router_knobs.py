"""Research knobs of the router and the run, each against a reference: the aux-loss-free balancing bias against a
hand computation (selection only, kept in checkpoints, zero after a Hugging Face load, left out of the export), the
router z-loss against its formula, the benchmarks' round-robin routing (equal loads by row position, the softmax's
weights, refused where a layout would route otherwise), and the held-out validation data (whole documents,
layout-independent batches). The same values under the parallel layouts: tests/test_parallel_train.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import train
from models import build_args, get_spec
from models.hf_io import export_state_dict_hf, load_hf_into_model
from models.moe import TopKRouter, round_robin_experts
from tests.conftest import compose_config
from training.config import config_warnings
from training.data.config import DataConfig
from training.data.loader import build_data_loader
from training.data.packing import Source, hold_out
from training.loss import router_loss_shares
from training.router_balance import update_expert_biases
from training import startup

ARCH = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64)


def test_bias_update_against_a_hand_computation() -> None:
    router = TopKRouter(8, 4, 2, norm_topk_prob=True, expert_bias=True)
    router.update_expert_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]), rate=0.1)  # mean 3: -1, +1, 0, 0 (mean 0)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    router.update_expert_bias(torch.tensor([1.0, 1.0, 1.0, 5.0]), rate=0.1)  # +.1 +.1 +.1 -.1, centred: -0.05
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.05, 0.15, 0.05, -0.15]))

    routers = [TopKRouter(8, 4, 2, True, expert_bias=True) for _ in range(2)]  # one per layer, in order
    update_expert_biases(routers, torch.tensor([[5.0, 1.0, 3.0, 3.0], [1.0, 1.0, 1.0, 5.0]]), 0.1, group=None)
    torch.testing.assert_close(routers[1].expert_bias, torch.tensor([0.05, 0.05, 0.05, -0.15]))


def test_the_bias_chooses_the_experts_and_the_probabilities_weigh_them() -> None:
    router = TopKRouter(4, 4, 2, norm_topk_prob=False, expert_bias=True)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))  # expert 3, the least likely, is pushed in
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    probs = torch.softmax(x, dim=-1)
    weights, experts, stats = router(x)
    assert experts.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, probs[:, [3, 0]])  # the weights carry no bias
    assert stats.counts_E.tolist() == [1.0, 0.0, 0.0, 1.0]
    torch.testing.assert_close(stats.z_sum, torch.logsumexp(x, dim=-1).square().sum())


def test_z_loss_share_against_its_formula_and_its_gradient() -> None:
    torch.manual_seed(0)
    routers = [TopKRouter(8, 4, 2, True, z_loss=True) for _ in range(3)]
    xs = [torch.randn(5, 8) for _ in routers]
    for router in routers:
        torch.nn.init.normal_(router.weight, std=0.5)
    stats = [router(x)[2] for router, x in zip(routers, xs)]
    aux, z = router_loss_shares(stats, num_experts=4)
    lse = torch.stack([torch.logsumexp(x @ r.weight.T, dim=-1) for r, x in zip(routers, xs)])  # [layers, tokens]
    torch.testing.assert_close(z, lse.square().mean())  # over all layers' tokens together
    z.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    quiet = TopKRouter(8, 4, 2, True)  # z_loss off: the statistic is there, with nothing kept for backward
    assert not quiet(xs[0])[2].z_sum.requires_grad


def test_round_robin_gives_every_expert_equal_loads_by_row_position() -> None:
    experts_NK = round_robin_experts(3 * 12, num_experts=8, top_k=2, row_len=12, device=torch.device("cpu"))
    rows = experts_NK.view(3, 12, 2)
    assert rows[0, :5].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1]]
    assert all(torch.equal(rows[0], row) for row in rows)  # by position in the row, not in the batch
    assert torch.bincount(rows[0].flatten(), minlength=8).tolist() == [3] * 8  # 24 slots of a row on 8 experts
    odd = round_robin_experts(5, num_experts=3, top_k=3, row_len=5, device=torch.device("cpu"))
    assert all(len(set(token)) == 3 for token in odd.tolist())  # K = E: every expert once per token
    # a cp rank's half of a 16-token row routes as the whole row does there, since 8 x K = 16 is a multiple of E
    whole = round_robin_experts(16, 8, 2, 16, torch.device("cpu"))
    assert torch.equal(whole[8:], round_robin_experts(8, 8, 2, 8, torch.device("cpu")))
    assert not torch.equal(whole[5:], round_robin_experts(11, 8, 2, 11, torch.device("cpu")))  # 11 x 2 is not


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_forced_balance_ignores_the_scores_and_keeps_their_weights(norm_topk_prob) -> None:
    torch.manual_seed(0)
    router = TopKRouter(8, 4, 2, norm_topk_prob, force_balance=True)
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(8, 8)
    weights, experts, stats = router(x, row_len=4)
    assert torch.equal(experts, round_robin_experts(8, 4, 2, 4, torch.device("cpu")))
    assert torch.equal(router(torch.randn(8, 8), row_len=4)[1], experts)  # whatever the tokens
    chosen = torch.softmax(x @ router.weight.T, dim=-1).gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True) if norm_topk_prob else chosen)
    assert stats.counts_E.tolist() == [4.0] * 4
    (weights * torch.randn_like(weights)).sum().backward()  # (renormalised weights sum to 1: a plain sum has no grad)
    assert router.weight.grad.abs().sum() > 0  # the router still learns through the weights it gives


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_both_families_route_round_robin_when_forced(family) -> None:
    arch = {**ARCH, "router_force_balance": True, "num_experts": 8}
    if family == "qwen3_5_moe":  # one DeltaNet layer, then one of gated attention
        arch.update(full_attention_interval=2, head_dim=16, mrope_section=[1, 1, 0], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                    shared_expert_intermediate_size=16)
    args = build_args(family, arch)
    model = get_spec(family).model_cls(args)
    model.init_weights()
    seen = []
    for router in model.routers():
        router.register_forward_hook(lambda module, inputs, out: seen.append(out[1]))
    model(torch.randint(0, 128, (2, 12)))
    assert len(seen) == 2
    for experts in seen:
        assert torch.equal(experts, round_robin_experts(24, 8, 2, 12, torch.device("cpu")))


def test_forced_balance_is_refused_where_it_cannot_hold_and_warned_of_where_it_runs() -> None:
    with pytest.raises(ValueError, match=r"force_balance=true .*router_bias_update_rate=0.01 has no loads .* to 0"):
        build_args("qwen3_moe", {**ARCH, "router_force_balance": True, "router_bias_update_rate": 0.01})
    # 8 experts top-2: a cp2 rank's 10 tokens of a 20-token row start at expert 20 mod 8 = 4, not 0
    cfg = compose_config(["parallel=cp2", "data.seq_len=20", "model.arch.router_force_balance=true"])
    with pytest.raises(ValueError, match=r"parallel.cp_size=2: .* 10 x model.arch.num_experts_per_tok=2 must be a "
                                         r"multiple of model.arch.num_experts=8 .* data.seq_len a multiple of 8"):
        startup.check_config(cfg, world_size=2)
    startup.check_config(compose_config(["parallel=cp2", "data.seq_len=24", "model.arch.router_force_balance=true"]),
                       world_size=2)
    startup.check_config(compose_config(["parallel=cp2", "data.seq_len=20"]), world_size=2)  # learned routing: fine
    warned = config_warnings(compose_config(["model.arch.router_force_balance=true"]))
    assert len(warned) == 1 and "router_force_balance=true" in warned[0] and "no usable model" in warned[0]


def test_the_bias_is_checkpointed_reset_by_a_hugging_face_load_and_left_out_of_the_export(tmp_path) -> None:
    args = build_args("qwen3_moe", {**ARCH, "router_bias_update_rate": 0.01})
    model = get_spec("qwen3_moe").model_cls(args)
    model.init_weights()
    assert [r.expert_bias.tolist() for r in model.routers()] == [[0.0] * 4] * 2
    for router in model.routers():
        router.expert_bias.fill_(0.5)
    state = model.state_dict()
    assert "model.layers.1.mlp.gate.expert_bias" in state  # a buffer: in checkpoints and the final weights
    export_state_dict_hf(state, "qwen3_moe", args, tmp_path / "hf")
    index = {name for f in (tmp_path / "hf").glob("*.safetensors") for name in _names(f)}
    assert "model.layers.0.mlp.gate.weight" in index and not any("expert_bias" in n for n in index)
    load_hf_into_model(model, tmp_path / "hf")
    assert [r.expert_bias.tolist() for r in model.routers()] == [[0.0] * 4] * 2


def _names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_hold_out_takes_whole_documents_from_the_tail() -> None:
    ids = np.array([5, 6, 0, 7, 8, 9, 0, 1, 2, 0, 3, 4, 4, 0])  # eos 0; documents start at 0, 3, 7, 10
    train_part, val_part = hold_out(Source("s", ids, ids * 10), 0.4, eos_id=0)  # cut at 8.4 -> the start at 10
    assert len(train_part.ids) == 10 and train_part.ids[np.arange(10)].tolist() == ids[:10].tolist()
    assert val_part.ids[np.arange(4)].tolist() == [3, 4, 4, 0] and val_part.mask[np.arange(4)].tolist() == [30, 40,
                                                                                                        40, 0]
    with pytest.raises(ValueError, match=r"no document starts in the last 5.0% of 's'"):
        hold_out(Source("s", ids[:12], None), 0.05, eos_id=0)


def test_validation_batches_do_not_depend_on_the_dp_layout(tmp_path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 100, size=4000)
    tokens[rng.choice(4000, 200, replace=False)] = 0
    np.save(tmp_path / "t.npy", tokens)
    cfg = DataConfig(name="tokens", path=str(tmp_path / "t.npy"), seq_len=15, cache_dir=str(tmp_path / "c"), eos_id=0,
                     val_fraction=0.2)
    one = build_data_loader(cfg, seed=0, local_batch_size=4, dp_rank=0, dp_size=1).validation.batches(3)
    two = [build_data_loader(cfg, seed=0, local_batch_size=2, dp_rank=r, dp_size=2).validation.batches(3)
           for r in range(2)]
    for k in range(3):
        for key in one[k]:
            assert torch.equal(one[k][key], torch.cat([two[0][k][key], two[1][k][key]]))
    assert one[0]["input_ids"][0].tolist() == tokens[-(len(tokens) - _cut(tokens, 0.2)):][:15].tolist()
    with pytest.raises(ValueError, match=r"train.eval_batches=99 .* raise data.val_fraction"):
        build_data_loader(cfg, seed=0, local_batch_size=4, dp_rank=0, dp_size=1).validation.batches(99)


def _cut(tokens: np.ndarray, fraction: float) -> int:
    """The first document start at or after (1 - fraction) of the tokens."""
    cut = int(len(tokens) * (1 - fraction))
    return cut if cut == 0 or tokens[cut - 1] == 0 else cut + int(np.flatnonzero(tokens[cut:] == 0)[0]) + 1


def test_a_run_logs_validation_and_z_losses_per_layer(tiny_run_config) -> None:
    cfg = tiny_run_config("train.steps=3", "train.eval_every=2", "train.eval_batches=1", "data.val_fraction=0.1",
                          "data.eos_id=0", "model.arch.router_z_loss_coef=0.01", "model.arch.router_bias_update_rate=0.01")
    history = train.run(cfg)
    assert [("val_loss" in m) for m in history] == [False, True, True]  # every 2 steps, and the last
    assert all(math.isfinite(m["val_loss"]) for m in history[1:])
    logged = [json.loads(line) for line in open(f"{cfg.train.output_dir}/metrics.jsonl")]
    assert "moe/layer1/z_loss" in logged[-1] and logged[-1]["z_loss"] > 0
    with pytest.raises(ValueError, match=r"train.eval_every=2 needs held-out data: set data.val_fraction"):
        train.run(tiny_run_config("train.eval_every=2"))
