"""Experts over a one-rank expert FSDP mesh (world = ep) are left out of FSDP
(``parallelisms.expert_parallel.replace_single_rank_fsdp``): ep2 on 2 gloo ranks trains like one process (fp32),
like the experts under FSDP (bf16 mixed precision: the same bits, each expert weight cast once per step), with the
same parameter layout, and checkpoints load across the two paths. The FSDP path is forced by patching
``expert_fsdp_is_one_rank`` in the ranks."""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import models
from parallelisms import BackendConfig, ParallelConfig, build_parallel_dims, clip_grad_norm_, parallelize_qwen3_moe
from parallelisms import compute_copy, parallelize
from parallelisms.compute_copy import cast_copies_
from tests.dist_utils import (assert_same_curve, debug_model_args, fsdp_param_groups, load_full_weights, loss_share,
                              run_distributed, seeded_weights, synthetic_batches, train_steps)
from training.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.torch_apis  # FSDP2 hooks, DTensor, DCP

WORLD, STEPS, LOCAL_BATCH, SEQ = 2, 3, 2, 16
SPEC = models.get_spec("qwen3_moe")
EP2 = ParallelConfig(ep_size=2, backend=BackendConfig())


def _build(dims, weights, param_dtype: torch.dtype, fsdp_experts: bool, cfg: ParallelConfig = EP2) -> torch.nn.Module:
    force = mock.patch.object(parallelize, "expert_fsdp_is_one_rank", lambda _: False) if fsdp_experts else nullcontext()
    with torch.device("meta"):
        model = SPEC.model_cls(debug_model_args())
    with force:
        model = parallelize_qwen3_moe(model, SPEC, dims, cfg, param_dtype, torch.float32)
    model.to_empty(device="cpu")
    load_full_weights(model, weights)
    return model


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    """What DCP sees of each parameter: global shape, placements, mesh shape, local shape."""
    return {name: (tuple(p.shape), tuple(map(repr, p.placements)), tuple(p.device_mesh.shape),
                   tuple(p.to_local().shape)) for name, p in model.named_parameters()}


def _full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, gathered (collective)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _full(value).items()})
        elif isinstance(value, torch.Tensor):
            out[str(key)] = value.full_tensor() if isinstance(value, DTensor) else value.clone()
    return out


def _step(model, dims, optimizer, tokens_GT1) -> float:
    share = loss_share(model, dims, tokens_GT1)
    (share * dims.grad_scale).backward()
    clip_grad_norm_(model, 0.5, dims)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = share.detach()
    dist.all_reduce(loss)
    return loss.item()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _worker(rank: int, world_size: int, weights, tokens, root: str) -> dict:
    dims = build_parallel_dims(EP2, world_size, rank, "cpu")
    out = {}
    # Who is an FSDP unit, and what the prefetch chains name.
    new, old = (_build(dims, weights, torch.float32, fsdp) for fsdp in (False, True))
    experts = new.model.layers[0].mlp.experts
    out["fsdp_experts"] = [isinstance(m.model.layers[0].mlp.experts, FSDPModule) for m in (new, old)]
    prefetched = new.model.embed_tokens._get_fsdp_state()._states_to_forward_prefetch
    out["prefetch"] = [s is new.model.layers[0]._get_fsdp_state() for s in prefetched]
    out["block_holds_experts"] = any(fp._module_info.module is experts  # private FSDP state
                                     for g in fsdp_param_groups(new.model.layers[0]._get_fsdp_state())
                                     for fp in g.fsdp_params)
    out["layout"] = [_layout(m) for m in (new, old)]
    del new, old

    # fp32 against one process: the loss curve and the first step's gradients.
    model = _build(dims, weights, torch.float32, False)
    (loss_share(model, dims, tokens[0]) * dims.grad_scale).backward()
    out["grads"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out["history"] = train_steps(model, dims, tokens)

    model = _build(dims, weights, torch.float32, False, replace(EP2, activation_checkpoint="full"))
    out["history_full_ac"] = train_steps(model, dims, tokens)

    # bf16 mixed precision, fp32 master weights and reduction: the same bits as the experts under FSDP, also
    # with two micro-batches per step and under full and selective checkpointing (see activation_checkpoint.py's
    # SAC_IGNORED_OPS for what selective needs without FSDP's hooks in the block). Fused AdamW, as on CUDA: it
    # bumps no version counter, so a bf16 copy not re-cast after its step would show here. Casts are counted
    # under full checkpointing with two micro-batches (one per step; per use it would be four).
    casts = Counter()

    def counted_cast(copies, params):
        casts.update(p.data_ptr() for p in params)  # the local tensors of the DTensor parameters
        cast_copies_(copies, params)

    for fsdp in (False, True):
        for case, cfg, micro_batches in (("bf16", EP2, 1), ("bf16_accumulation", EP2, 2),
                                         ("bf16_full_ac", replace(EP2, activation_checkpoint="full"), 2),
                                         ("bf16_selective_ac", replace(EP2, activation_checkpoint="selective"), 1)):
            model = _build(dims, weights, torch.bfloat16, fsdp, cfg)
            with mock.patch.object(compute_copy, "cast_copies_", counted_cast):
                history = train_steps(model, dims, tokens, micro_batches=micro_batches, fused=True)
            out[case, fsdp] = history, _full(model.state_dict())
            if case == "bf16_full_ac" and not fsdp:
                expert_params = [p for n, p in model.named_parameters() if ".mlp.experts." in n]
                out["casts"] = sorted(casts[p.to_local().data_ptr()] for p in expert_params)
            casts.clear()

    # Checkpoints across the paths: new saves after 2 steps, old resumes, steps and saves, new loads that.
    a = _build(dims, weights, torch.float32, False)
    opt_a = _adamw(a)
    losses_a = [_step(a, dims, opt_a, t) for t in tokens]
    a = _build(dims, weights, torch.float32, False)
    opt_a = _adamw(a)
    for t in tokens[:2]:
        _step(a, dims, opt_a, t)
    saved_a = save_checkpoint(Path(root, "new"), 2, a, opt_a, {}, keep_last=1, is_writer=rank == 0)
    b = _build(dims, weights, torch.float32, True)
    opt_b = _adamw(b)
    load_checkpoint(saved_a, b, opt_b, None)
    out["resumed_loss"] = (_step(b, dims, opt_b, tokens[2]), losses_a[2])
    saved_b = save_checkpoint(Path(root, "old"), 3, b, opt_b, {}, keep_last=1, is_writer=rank == 0)
    c = _build(dims, weights, torch.float32, False)
    opt_c = _adamw(c)
    load_checkpoint(saved_b, c, opt_c, None)
    out["resumed_state"] = [_full(dict(zip(("model", "optim"), get_state_dict(m, o)))) for m, o in
                            ((b, opt_b), (c, opt_c))]
    return out


def _reference(weights, tokens) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = ParallelConfig(backend=BackendConfig(name="none"))
    dims = build_parallel_dims(cfg, 1, 0, "cpu")
    model = SPEC.model_cls(debug_model_args())
    load_full_weights(model, weights)
    loss_share(model, dims, tokens[0]).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return train_steps(model, dims, tokens), grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tokens = synthetic_batches(STEPS, LOCAL_BATCH * WORLD, SEQ, debug_model_args().vocab_size)
    weights = seeded_weights(debug_model_args())
    out = run_distributed(_worker, WORLD, weights, tokens, str(tmp_path_factory.mktemp("ckpt")))
    return out, _reference(weights, tokens)


def test_ep2_experts_are_no_fsdp_unit_and_no_block_holds_them(runs):
    out, _ = runs
    assert out["fsdp_experts"] == [False, True]
    assert out["prefetch"] == [True]  # embeddings -> block 0 only: its experts gather nothing
    assert not out["block_holds_experts"]


def test_ep2_parameters_look_as_under_fsdp(runs):
    new, old = runs[0]["layout"]
    assert new == old
    gate_up = new["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up[1] == ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)") and gate_up[2] == (1, 2), gate_up


def test_ep2_trains_like_one_process_in_fp32(runs):
    out, (history, grads) = runs
    assert_same_curve(out["history"], history, steps=list(range(1, STEPS + 1)))
    assert_same_curve(out["history_full_ac"], history, steps=list(range(1, STEPS + 1)))
    assert history[0]["grad_norm"] > 0.5  # clipping active
    assert set(out["grads"]) == set(grads)
    for name, want in grads.items():
        torch.testing.assert_close(out["grads"][name], want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["bf16", "bf16_accumulation", "bf16_full_ac", "bf16_selective_ac"])
def test_ep2_bf16_matches_fsdp_experts_bit_for_bit(runs, case):
    out, _ = runs
    (history, weights), (fsdp_history, fsdp_weights) = out[case, False], out[case, True]
    assert history == fsdp_history
    for name, want in fsdp_weights.items():
        assert torch.equal(weights[name], want), name


def test_ep2_experts_are_cast_to_bf16_once_per_step(runs):
    assert set(runs[0]["casts"]) == {STEPS}


def test_checkpoints_load_across_fsdp_and_bare_experts(runs):
    out, _ = runs
    resumed, uninterrupted = out["resumed_loss"]
    assert resumed == pytest.approx(uninterrupted, rel=1e-6)
    old, new = out["resumed_state"]
    assert set(old) == set(new) and any(".mlp.experts." in k for k in old) and any("exp_avg" in k for k in old)
    for key, want in old.items():
        torch.testing.assert_close(new[key], want, rtol=0, atol=0, msg=key)


def test_fsdp_keeps_the_experts_where_their_mesh_has_more_ranks():
    """Meta-device layouts on a fake world: only world = ep leaves the experts out of FSDP."""
    layouts = {(4, 2, -1): True, (4, 2, 1): True, (4, 4, -1): False, (8, 8, -1): False, (8, 2, 2): True}
    for (world, ep, efsdp), managed in layouts.items():
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
        try:
            cfg = ParallelConfig(ep_size=ep, efsdp_size=efsdp, backend=BackendConfig())
            dims = build_parallel_dims(cfg, world, 1, "cpu")
            with torch.device("meta"):
                model = SPEC.model_cls(debug_model_args())
            parallelize_qwen3_moe(model, SPEC, dims, cfg, torch.bfloat16, torch.float32)
            assert isinstance(model.model.layers[0].mlp.experts, FSDPModule) == managed, (world, ep, efsdp)
        finally:
            dist.destroy_process_group()
    for world, cfg in ((4, ParallelConfig(cp_size=2, ep_size=2, efsdp_size=1, backend=BackendConfig())),):
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
        try:  # cp2 x ep2 on 4: efsdp = edp = 1, but the experts are replicated over expert_cp
            dims = build_parallel_dims(cfg, world, 1, "cpu")
            with torch.device("meta"):
                model = SPEC.model_cls(debug_model_args())
            parallelize_qwen3_moe(model, SPEC, dims, cfg, torch.bfloat16, torch.float32)
            assert isinstance(model.model.layers[0].mlp.experts, FSDPModule)
        finally:
            dist.destroy_process_group()
