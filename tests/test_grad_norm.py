"""Cross-mesh gradient clipping on 2 gloo ranks (and 4, for experts split over ep and efsdp both): the norm equals
the norm of the gathered (unsharded) gradients for plain, FSDP, HSDP and EP+expert-FSDP layouts, clipping scales every shard by one coefficient,
and the warm-up call before any backward runs the same collectives on every rank and returns 0."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import models
from parallelisms import build_parallel_dims, clip_grad_norm_, parallelize_qwen3_moe
from tests.conftest import compose_config
from tests.dist_utils import (debug_model_args, load_full_weights, loss_share, run_distributed, seeded_weights,
                              synthetic_batches)

pytestmark = pytest.mark.torch_apis  # DTensor norms under FSDP2 / EP

WORLD = 2
PRESETS = ["ddp", "fsdp2", "hsdp", "ep2"]


def _full_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies: full_tensor() may return the local tensor itself when no dim is really sharded."""
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for p in model.parameters()]


def _norm_worker(rank: int, world_size: int, cfgs: dict, weights: dict, tokens_GT1: torch.Tensor) -> dict:
    spec = models.get_spec("qwen3_moe")
    out = {}
    for name, cfg in cfgs.items():
        dims = build_parallel_dims(cfg, world_size, rank, "cpu")
        with torch.device("meta"):
            model = spec.model_cls(debug_model_args())
        model = parallelize_qwen3_moe(model, spec, dims, cfg, torch.float32, torch.float32)
        model.to_empty(device="cpu")
        load_full_weights(model, weights)
        warm_up = clip_grad_norm_(model, 1.0, dims).item()

        (loss_share(model, dims, tokens_GT1) * dims.grad_scale).backward()
        full = _full_grads(model)
        unsharded = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full])).item()
        norm = clip_grad_norm_(model, 0.0, dims).item()  # norm only
        unchanged = all(torch.equal(a, b) for a, b in zip(_full_grads(model), full))
        clipped_norm = clip_grad_norm_(model, unsharded / 4, dims).item()
        coef = (unsharded / 4) / (clipped_norm + 1e-6)
        scaled = max(float((a - b * coef).abs().max()) for a, b in zip(_full_grads(model), full))
        out[name] = dict(warm_up=warm_up, unsharded=unsharded, norm=norm, unchanged=unchanged,
                         clipped_norm=clipped_norm, scale_error=scaled)
    return out


def _norms(world: int, presets: list[str]) -> dict:
    cfgs = {p: compose_config([f"parallel={p}"]).parallel for p in presets}
    tokens = synthetic_batches(1, 4, 16, debug_model_args().vocab_size)[0]
    return run_distributed(_norm_worker, world, cfgs, seeded_weights(debug_model_args()), tokens)


@pytest.fixture(scope="module")
def norms():
    return _norms(WORLD, PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_norm_equals_the_unsharded_norm_and_clipping_scales_every_shard(norms, preset):
    _check_norm(norms[preset])


def test_the_norm_counts_both_expert_groups_where_experts_are_split_over_ep_and_efsdp():
    """ep2 on 4 ranks: each expert weight is sharded over ep (which experts) and over efsdp 2 (their rows), so its
    squares are summed over both groups (on 2 ranks no layout has both)."""
    _check_norm(_norms(4, ["ep2"])["ep2"])


def _check_norm(r: dict) -> None:
    assert r["warm_up"] == 0.0
    assert r["norm"] == pytest.approx(r["unsharded"], rel=1e-5)  # fp32 sums in a different order
    assert r["unchanged"]  # max_norm <= 0 only measures
    assert r["clipped_norm"] == pytest.approx(r["unsharded"], rel=1e-5)
    assert r["scale_error"] < 1e-7


def test_single_process_norm_is_torch_clip_grad_norm():
    torch.manual_seed(0)
    model = models.get_spec("qwen3_moe").model_cls(debug_model_args())
    model.init_weights()
    dims = build_parallel_dims(compose_config(["parallel=single"]).parallel, 1, 0, "cpu")
    (loss_share(model, dims, synthetic_batches(1, 2, 8, debug_model_args().vocab_size)[0])).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    want = torch.nn.utils.get_total_norm(reference)
    got = clip_grad_norm_(model, 0.1, dims)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    coef = 0.1 / (want + 1e-6)
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, g * coef)
