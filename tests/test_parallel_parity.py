"""Every parallel layout trains exactly like one process: same weights, same data, same loss and grad norm.

One spawn of 8 gloo ranks runs every case in turn (a spawn costs seconds; a case well under one). The
reference is the same loop on one process with backend none over the whole global batch. Tolerance:
fp32 throughout, the layouts differ only in summation order (reduce-scatter, all-to-all, sharded norms),
so rel 1e-4 over 3 AdamW steps.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import models
from models.moe import SparseMoeBlock
from parallelisms import (BackendConfig, ParallelConfig, build_parallel_dims, expert_shard_dim, parallelize_qwen3_moe,
                          resolve_sizes)
from parallelisms.parallelize import shard_experts
from tests.conftest import compose_config
from tests.dist_utils import (debug_model_args, load_full_weights, run_distributed, seeded_weights,
                              synthetic_batches, train_steps)

pytestmark = pytest.mark.torch_apis  # FSDP2 / EP layouts on gloo ranks

WORLD = 8
STEPS, LOCAL_BATCH, SEQ = 3, 2, 16
# (cp, ep, efsdp) on 8 ranks, so edp = 8 / (cp * ep * efsdp): replication over edp, expert_cp, both, neither.
LAYER_LAYOUTS = {
    f"cp{cp}_ep{ep}_efsdp{efsdp}_edp{WORLD // (cp * ep * efsdp)}": ParallelConfig(
        cp_size=cp, ep_size=ep, efsdp_size=efsdp, backend=BackendConfig())
    for cp, ep, efsdp in [(2, 2, 2), (2, 2, 1), (1, 2, 2), (1, 2, 1), (2, 4, 1), (1, 1, 4)]
}
# Every preset that fits 8 ranks (test_parallel_config.py checks which ones validate), with 8 experts.
FITTING_PRESETS = ["ddp", "fsdp2", "hsdp", "ep2", "ep4", "ep8", "ep4_efsdp2", "ep2_edp2"]
# What the presets miss: name -> (preset, num_experts, ParallelConfig changes). With 4 experts efsdp x ep = 8 > 4,
# so the expert FSDP shards dim 1 (with and without EP); and the two activation checkpointing modes under EP.
VARIANTS = {
    "fsdp2_4_experts": ("fsdp2", 4, {}),
    "ep4_4_experts": ("ep4", 4, {}),
    "ep4_full_ac": ("ep4", 8, {"activation_checkpoint": "full"}),
    "ep2_edp2_selective_ac": ("ep2_edp2", 8, {"activation_checkpoint": "selective"}),
}
CASES = FITTING_PRESETS + list(VARIANTS)


def _run_case(cfg: ParallelConfig, num_experts: int, weights, tokens, world_size: int, rank: int) -> dict:
    spec = models.get_spec("qwen3_moe")
    dims = build_parallel_dims(cfg, world_size, rank, "cpu")
    with torch.device("meta"):
        model = spec.model_cls(debug_model_args(num_experts=num_experts))
    model = parallelize_qwen3_moe(model, spec, dims, cfg, torch.float32, torch.float32)
    model.to_empty(device="cpu")
    load_full_weights(model, weights)
    history = train_steps(model, dims, tokens)
    expert = model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    placements = [(type(p).__name__, getattr(p, "dim", None)) for p in getattr(expert, "placements", ())]
    return {"history": history, "expert_placements": placements}


def _moe_layer_grads(cfg: ParallelConfig, world_size: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One MoE layer (router + experts) under the expert plan with cp > 1 allowed: CP splits a sequence, and a
    token-wise layer cannot tell that from a data split, so this checks the expert gradient scaling for
    every (edp, efsdp, ep, cp) before CP itself exists. Returns {param: (sharded-run grad, reference grad)}."""
    dims = build_parallel_dims(cfg, world_size, rank, "cpu")
    torch.manual_seed(0)
    x_ND = torch.randn(world_size * 6, 16)
    layers = []
    for _ in range(2):  # the reference and the one to shard, from the same initialisation
        torch.manual_seed(1)
        layer = SparseMoeBlock(dim=16, num_experts=8, top_k=2, intermediate=8, norm_topk_prob=True)
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.5)
        layers.append(layer)
    reference, layer = layers
    (reference(x_ND[None])[0].pow(2).sum() / len(x_ND)).backward()

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    shard_experts([layer.experts], dims, cfg.backend, mp_policy)
    fully_shard(layer, mesh=dims.mesh("fsdp"), mp_policy=mp_policy)
    x_nD = x_ND.chunk(world_size)[rank]  # rank = dp_rank * cp + cp_rank: every rank its own tokens
    share = layer(x_nD[None])[0].pow(2).sum() / len(x_ND)
    (share * dims.grad_scale).backward()
    return {name: (param.grad.full_tensor(), reference.get_parameter(name).grad)
            for name, param in layer.named_parameters()}


def _parity_worker(rank: int, world_size: int, cases: dict, weights: dict, tokens) -> dict:
    runs = {name: _run_case(cfg, num_experts, weights[num_experts], tokens, world_size, rank)
            for name, (cfg, num_experts) in cases.items()}
    layer_grads = {name: _moe_layer_grads(cfg, world_size, rank) for name, cfg in LAYER_LAYOUTS.items()}
    return runs, layer_grads


def _reference(num_experts: int, weights, tokens) -> list[dict]:
    spec = models.get_spec("qwen3_moe")
    cfg = ParallelConfig(backend=BackendConfig(name="none"))
    model = spec.model_cls(debug_model_args(num_experts=num_experts))
    load_full_weights(model, weights)
    return train_steps(model, build_parallel_dims(cfg, 1, 0, "cpu"), tokens)


def _cases() -> dict[str, tuple[ParallelConfig, int]]:
    cases = {p: (compose_config([f"parallel={p}"]).parallel, 8) for p in FITTING_PRESETS}
    for name, (preset, num_experts, changes) in VARIANTS.items():
        cases[name] = (replace(cases[preset][0], **changes), num_experts)
    return cases


@pytest.fixture(scope="module")
def parity_runs():
    tokens = synthetic_batches(STEPS, LOCAL_BATCH * WORLD, SEQ, debug_model_args().vocab_size)
    weights = {e: seeded_weights(debug_model_args(num_experts=e)) for e in (4, 8)}
    cases = _cases()
    results, layer_grads = run_distributed(_parity_worker, WORLD, cases, weights, tokens)
    references = {e: _reference(e, weights[e], tokens) for e in weights}
    return cases, results, references, layer_grads


@pytest.mark.parametrize("name", CASES)
def test_layout_matches_single_process_loss_and_grad_norm(parity_runs, name):
    cases, results, references, _ = parity_runs
    got, want = results[name]["history"], references[cases[name][1]]
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
    assert want[0]["grad_norm"] > 0.5  # the first step really clipped (max_norm 0.5): the coefficient is shared


def test_expert_fsdp_shards_dim_1_exactly_when_efsdp_times_ep_exceeds_the_experts(parity_runs):
    cases, results, *_ = parity_runs
    for name, (cfg, num_experts) in cases.items():
        if cfg.backend.name != "fsdp2":
            continue
        sizes = resolve_sizes(cfg, WORLD)
        shard_dim = expert_shard_dim(sizes.efsdp, sizes.ep, num_experts)
        placements = results[name]["expert_placements"]  # [(edp_cp: Replicate,) efsdp, (ep: Shard(0))]
        assert placements[-2 if sizes.ep > 1 else -1][1] == shard_dim, (name, placements)
        if sizes.ep > 1:
            assert placements[-1] == ("Shard", 0), (name, placements)
        assert (shard_dim == 1) == (name in ("fsdp2_4_experts", "ep4_4_experts")), name


@pytest.mark.parametrize("layout", sorted(LAYER_LAYOUTS))
def test_expert_and_router_gradients_equal_the_global_loss_gradient_with_edp_and_cp(parity_runs, layout):
    """Expert grads: the all-to-all backward sums the ep ranks' tokens, the expert FSDP sums over efsdp, edp
    and expert_cp, and the divide factor dp x cp cancels grad_scale; the router's FSDP averages over all."""
    grads = parity_runs[3][layout]
    assert set(grads) == {"gate.weight", "experts.gate_up_proj", "experts.down_proj"}
    for name, (got, want) in grads.items():
        # fp32, summed in other orders: an entry that cancels to near zero keeps an error of the tensor's scale, not
        # its own, so atol is relative to the largest entry (a wrong scaling or a lost rank is off by O(1)).
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{layout}: {name}: {m}")
