"""Meshes and the sharding plan for large topologies, in one process: a fake process group of 16 or 32 ranks
builds the real meshes and parallelizes the model on the meta device (no communication happens there), so
mesh shapes, rank groups, placements, divide factors and prefetch chains are checked without 16 processes.
Numerics live in the multi-process tests (test_parallel_parity.py, test_dispatch.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import models
from parallelisms import (BackendConfig, ParallelConfig, build_parallel_dims, expert_shard_dim, parallelize_qwen3_moe,
                          resolve_sizes)
from tests.conftest import compose_config
from tests.dist_utils import debug_model_args, fsdp_param_groups

pytestmark = pytest.mark.torch_apis  # DeviceMesh, FSDP2 and DTensor placements

SPEC = models.get_spec("qwen3_moe")


@pytest.fixture
def fake_world():
    """init(world_size, rank): a fake default process group, destroyed after the test."""

    def init(world_size: int, rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _cfg(**kwargs) -> ParallelConfig:
    backend = {k: kwargs.pop(k) for k in list(kwargs) if k in BackendConfig.__dataclass_fields__}
    return ParallelConfig(**kwargs, backend=BackendConfig(**backend))


def _ranks(mesh) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group())


def _parallelized(cfg: ParallelConfig, world_size: int, rank: int, **arch):
    dims = build_parallel_dims(cfg, world_size, rank, "cpu")
    with torch.device("meta"):
        model = SPEC.model_cls(debug_model_args(**arch))
    return parallelize_qwen3_moe(model, SPEC, dims, cfg, torch.bfloat16, torch.float32), dims


@pytest.mark.parametrize("world, kwargs, expert_shape", [
    (16, dict(ep_size=8), (1, 2, 8, 1)),  # the design's example
    (16, dict(ep_size=4, efsdp_size=2), (2, 2, 4, 1)),
    (32, dict(ep_size=8, efsdp_size=2), (2, 2, 8, 1)),
    (16, dict(cp_size=2, ep_size=4, efsdp_size=2), (1, 2, 4, 2)),
    (128, dict(ep_size=16), (1, 8, 16, 1)),
    (8, dict(), (1, 8, 1, 1)),
])
def test_expert_mesh_shape_is_pure_arithmetic(world, kwargs, expert_shape):
    assert resolve_sizes(_cfg(**kwargs), world).expert_mesh_shape == expert_shape


def test_world_16_ep_8_meshes_and_rank_groups(fake_world):
    fake_world(16, rank=5)
    dims = build_parallel_dims(_cfg(ep_size=8, mp_replicate_size=2), 16, 5, "cpu")
    expert = dims.mesh("expert")
    assert expert.mesh_dim_names == ("edp", "efsdp", "ep", "expert_cp") and tuple(expert.shape) == (1, 2, 8, 1)
    assert _ranks(dims.mesh("ep")) == list(range(8))  # rank 5 is efsdp 0, ep 5
    assert _ranks(dims.mesh("efsdp")) == [5, 13]
    assert dims.mesh("expert_fsdp") is dims.mesh("efsdp")  # nothing to replicate over: plain FSDP
    assert tuple(dims.mesh("fsdp").shape) == (2, 8) and _ranks(dims.mesh("mp_shard")) == list(range(8))
    assert (dims.dp, dims.dp_rank, dims.grad_scale) == (16, 5, 16.0)
    assert dist.get_world_size(dims.data_group) == 16


def test_world_16_cp_2_expert_hsdp_replicates_over_edp_and_expert_cp(fake_world):
    fake_world(16, rank=5)
    dims = build_parallel_dims(_cfg(cp_size=2, ep_size=2, efsdp_size=2), 16, 5, "cpu")
    assert (dims.dp, dims.cp, dims.ep, dims.efsdp, dims.edp) == (8, 2, 2, 2, 2)
    assert dims.dp_rank == 2 and _ranks(dims.mesh("cp")) == [4, 5]  # cp ranks of one batch slice are neighbours
    assert _ranks(dims.mesh("ep")) == [5, 7] and _ranks(dims.mesh("efsdp")) == [1, 5]
    hsdp = dims.mesh("expert_fsdp")
    assert hsdp.mesh_dim_names == ("edp_cp", "efsdp") and tuple(hsdp.shape) == (4, 2)
    assert _ranks(dims.mesh("edp_cp")) == [4, 5, 12, 13]
    assert dims.grad_scale == 16.0


@pytest.mark.parametrize("world, kwargs, num_experts", [
    (16, dict(ep_size=8), 8), (16, dict(ep_size=8), 16), (16, dict(ep_size=4), 16), (16, dict(ep_size=4), 8),
    (32, dict(ep_size=8, efsdp_size=2), 16), (32, dict(ep_size=8), 16), (16, dict(), 16), (16, dict(), 8),
    (16, dict(ep_size=2, efsdp_size=2, mp_replicate_size=2), 8),
])
def test_expert_params_shard_dim_1_exactly_when_efsdp_times_ep_exceeds_the_experts(fake_world, world, kwargs,
                                                                                  num_experts):
    fake_world(world, rank=3)
    cfg = _cfg(**kwargs)
    model, dims = _parallelized(cfg, world, 3, num_experts=num_experts)
    shard_dim = 1 if dims.efsdp * dims.ep > num_experts else 0
    assert expert_shard_dim(dims.efsdp, dims.ep, num_experts) == shard_dim
    for block in model.model.layers:
        experts = block.mlp.experts
        for param in experts.parameters():
            assert isinstance(param, DTensor) and param.shape[0] == num_experts  # global shape: whole tensor
            names = param.device_mesh.mesh_dim_names
            efsdp = param.placements[names.index("efsdp")]
            assert efsdp.dim == shard_dim and not efsdp.is_replicate()
            if dims.ep > 1:
                assert param.placements[names.index("ep")].dim == 0
            if dims.edp > 1:
                assert param.placements[names.index("edp_cp")].is_replicate()
        assert experts.num_experts == num_experts // dims.ep  # the model sees its local experts
        # Private FSDP state, read to pin the divide factor that the gradient test proves numerically.
        assert [g.gradient_divide_factor for g in fsdp_param_groups(experts._get_fsdp_state())] == [dims.dp * dims.cp]
    attention = model.model.layers[0].self_attn.q_proj.weight
    assert attention.device_mesh.mesh_dim_names[-1] == "mp_shard"  # dense params: the outer FSDP mesh
    assert attention.dtype == torch.float32  # stored fp32; bf16 only inside forward (mixed precision)


def _param_groups(model) -> dict[str, list]:
    """FSDP unit name -> its parameter groups (private FSDP state; the root owns no parameters here)."""
    return {name: fsdp_param_groups(module._get_fsdp_state()) for name, module in model.named_modules()
            if isinstance(module, FSDPModule) and fsdp_param_groups(module._get_fsdp_state())}


# Expected divide factors by hand, docs/parallel.md: dense units average over their mesh, every rank (world =
# dp x cp); the experts over dp x cp too, set explicitly: their own mesh (edp*cp, efsdp) holds fewer ranks.
#   cp2_ep2_efsdp2 on 8:  dp 4, cp 2, ep 2, efsdp 2, edp 1 -> experts 4 x 2 = 8, expert mesh (1*2, 2) = 4 ranks
#   cp2_ep2_edp2   on 8:  dp 4, cp 2, ep 2, efsdp 1, edp 2 -> experts 4 x 2 = 8, expert mesh (2*2, 1) = 4 ranks
#   cp2_ep4_efsdp2 on 16: dp 8, cp 2, ep 4, efsdp 2, edp 1 -> experts 8 x 2 = 16, expert mesh (1*2, 2) = 4 ranks
@pytest.mark.parametrize("preset, world, dense_factor, expert_factor, expert_mesh", [
    ("cp2_ep2_efsdp2", 8, 8, 8, (2, 2)),
    ("cp2_ep2_edp2", 8, 8, 8, (4, 1)),
    ("cp2_ep4_efsdp2", 16, 16, 16, (2, 2)),
])
def test_cp_presets_divide_dense_and_expert_gradients_by_dp_times_cp(fake_world, preset, world, dense_factor,
                                                                      expert_factor, expert_mesh):
    """The divide factor of every FSDP unit under the CP presets against the hand-derived dp x cp."""
    fake_world(world, rank=3)
    cfg = compose_config([f"parallel={preset}"]).parallel
    model, dims = _parallelized(cfg, world, 3)
    assert dims.cp == 2
    groups = _param_groups(model)
    experts = {f"model.layers.{i}.mlp.experts" for i in range(len(model.model.layers))}
    assert experts < set(groups)
    for name, unit_groups in groups.items():
        for group in unit_groups:
            mesh = group.mesh_info.mesh
            if name in experts:
                assert tuple(mesh.shape) == expert_mesh, name
                assert group.gradient_divide_factor == expert_factor, name
            else:  # no factor set: FSDP averages over its mesh (shard x replicate ranks)
                assert group.gradient_divide_factor is None and mesh.size() == dense_factor, name


def test_bf16_mixed_precision_reduces_gradients_in_fp32_in_every_fsdp_unit(fake_world, tiny_run_config, monkeypatch):
    """The dtypes train.py hands the plan under train.mixed_precision=bf16, and the policy of every FSDP unit
    (experts included) they give: bf16 parameters, fp32 gradient reduction."""
    import parallelisms
    import train

    class Stop(Exception):
        pass

    dtypes = []

    def spy(*args, **kwargs):
        dtypes.append(tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.dtype)))
        raise Stop

    monkeypatch.setattr(parallelisms, "parallelize_qwen3_moe", spy)
    with pytest.raises(Stop):
        train.run(tiny_run_config("train.device=cpu", "train.mixed_precision=bf16", "train.steps=1"))
    assert dtypes == [(torch.bfloat16, torch.float32)]
    monkeypatch.undo()

    fake_world(8, rank=3)
    for preset in ("ep2_edp2", "cp2_ep2_efsdp2", "hsdp"):  # experts under expert HSDP, with CP; dense HSDP
        cfg = compose_config([f"parallel={preset}"]).parallel
        dims = build_parallel_dims(cfg, 8, 3, "cpu")
        with torch.device("meta"):
            model = SPEC.model_cls(debug_model_args())
        parallelize_qwen3_moe(model, SPEC, dims, cfg, *dtypes[0])
        groups = _param_groups(model)
        layers = range(len(model.model.layers))
        assert set(groups) == {"model.embed_tokens", "model.norm", "lm_head", *(f"model.layers.{i}" for i in layers),
                               *(f"model.layers.{i}.mlp.experts" for i in layers)}, preset
        for name, unit_groups in groups.items():
            for group in unit_groups:
                policy = group.mp_policy
                assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), (preset, name)


def test_prefetch_chains_follow_the_blocks_and_their_experts(fake_world):
    fake_world(16, rank=0)
    model, _ = _parallelized(_cfg(ep_size=8), 16, 0, num_hidden_layers=3)
    layers, embed, norm = list(model.model.layers), model.model.embed_tokens, model.model.norm
    experts = [layer.mlp.experts for layer in layers]

    def states(modules):
        return [m._get_fsdp_state() for m in modules]

    forward = {embed: [layers[0], experts[0]], layers[0]: [layers[1], experts[1]],
               layers[1]: [layers[2], experts[2]], layers[2]: [norm]}
    backward = {norm: [layers[2], experts[2]], layers[2]: [layers[1], experts[1]],
                layers[1]: [layers[0], experts[0]], layers[0]: [embed]}
    for module, after in forward.items():
        assert module._get_fsdp_state()._states_to_forward_prefetch == states(after)
    for module, before in backward.items():
        assert module._get_fsdp_state()._states_to_backward_prefetch == states(before)
    assert norm._get_fsdp_state() is model.lm_head._get_fsdp_state()  # final norm + LM head: one unit


def test_ignored_modules_must_be_frozen_and_must_exist(fake_world):
    fake_world(16, rank=0)
    cfg = _cfg(ep_size=8, fsdp_ignored_modules=["model.layers.*.mlp.gate"])
    with pytest.raises(NotImplementedError, match=r"model.layers.0.mlp.gate has trainable parameters \['weight'\]"):
        _parallelized(cfg, 16, 0)
    dims = build_parallel_dims(cfg, 16, 0, "cpu")
    with torch.device("meta"):
        model = SPEC.model_cls(debug_model_args())
    for layer in model.model.layers:
        layer.mlp.gate.requires_grad_(False)
    parallelize_qwen3_moe(model, SPEC, dims, cfg, torch.float32, torch.float32)
    assert not isinstance(model.model.layers[1].mlp.gate.weight, DTensor)  # whole on every rank
    assert isinstance(model.model.layers[1].self_attn.q_proj.weight, DTensor)
    with pytest.raises(ValueError, match=r"fsdp_ignored_modules: 'model.layerz\.\*' matches no module"):
        _parallelized(_cfg(fsdp_ignored_modules=["model.layerz.*"]), 16, 0)


def test_plan_shards_a_tied_head_with_its_embedding(fake_world):
    """The tied head and the embedding are one FSDP unit (a parameter of two units would be sharded twice)."""
    fake_world(16, rank=0)
    model, _ = _parallelized(_cfg(), 16, 0, tie_word_embeddings=True)
    model.to_empty(device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert fully_shard.state(model.lm_head) is fully_shard.state(model.model.embed_tokens)


def test_plan_rejects_what_fsdp2_cannot_shard(fake_world):
    fake_world(16, rank=0)
    # 16 ranks, 8 experts: dim 1 is sharded 16 ways, and down_proj's dim 1 (hidden 40) does not divide.
    with pytest.raises(ValueError, match=r"experts.down_proj \(8, 40, 32\): efsdp=16 .* dim 1"):
        _parallelized(_cfg(), 16, 0, hidden_size=40)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_single_process_keeps_the_model_and_its_parameter_names(mode):
    dims = build_parallel_dims(_cfg(name="none"), 1, 0, "cpu")
    torch.manual_seed(0)
    model = SPEC.model_cls(debug_model_args())
    model.init_weights()
    names = list(model.state_dict())
    tokens = torch.randint(0, 512, (2, 8))
    expected = model(tokens).logits
    assert parallelize_qwen3_moe(model, SPEC, dims, _cfg(name="none", activation_checkpoint=mode), torch.float32,
                                 torch.float32) is model
    assert list(model.state_dict()) == names
    out = model(tokens).logits
    torch.testing.assert_close(out, expected)
    out.sum().backward()  # recomputation under full / selective checkpointing
    assert all(p.grad is not None for p in model.parameters())
