"""The fused, domino, dedup and mc2 EP dispatchers against the single-rank LocalDispatcher, and end to end against
eager.

Dispatch level (as tests/test_dispatch.py, whose routing cases it reuses): outputs, input and router-weight
gradients, and expert gradients (summed over the ep group) on 2 and 4 gloo ranks, with experts that get no
token, a rank with no token at all, a rank receiving nothing, tokens whose K experts all sit on one (other)
rank, odd token counts (domino splits 7 tokens into 4 + 3), a single token (halves of 1 and 0), top-1 and
top-4. dedup's dispatch and combine move one row per distinct (token, rank) pair, fewer than fused's one per
(token, k). The NPU paths run with a fake ``torch_npu`` (tests/fake_torch_npu.py) whose
ops follow the torch_npu docs in plain torch (so this checks our glue: count directions, weight layouts,
the backward pairing of the MC2 ops; the real kernels need an Ascend machine).
End to end: the debug model, 3 steps under ep2, dispatcher=fused / domino / dedup (also under selective and full
activation checkpointing) log the loss and grad norm of dispatcher=eager: fp32 to rel 1e-5 (summation order
only), and close to eager's in bf16.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra.errors import MissingConfigException
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import models
import train
from kernels.config import KernelConfig
from kernels.moe import npu as npu_moe
from kernels.registry import Env, install, installed_kernels, select_kernels
from models.moe import GroupedExperts
from parallelisms import build_parallel_dims, parallelize_qwen3_moe
from parallelisms.dispatchers import DISPATCHERS, Dispatcher, DispatcherConfig, base, dispatcher_class
from parallelisms.dispatchers import dedup, domino, fused, mc2, npu
from parallelisms.dispatchers.dedup import DedupDispatcher
from parallelisms.dispatchers.domino import DominoDispatcher
from parallelisms.dispatchers.fused import FusedDispatcher
from parallelisms.dispatchers.mc2 import Mc2Dispatcher
from parallelisms.dispatchers.common import group_device_type
from parallelisms.expert_parallel import apply_expert_parallel
from tests.fake_torch_npu import FLOATS, GLUE, FakeTorchNpu, install as install_torch_npu
from tests.conftest import CONF_DIR, compose_config
from tests.dist_utils import debug_model_args, run_distributed
from tests.test_dispatch import CASES, D, E, I, K, _errors, _experts_NK, check_errors
from tests.test_parallel_train import train_config, write_inputs
from training.config import validate

pytestmark = pytest.mark.torch_apis  # EP all-to-alls, grouped_mm, FSDP2 on gloo ranks

ROUTINGS = [*CASES, "one_token", "top1", "top4"]
NPU_ROUTINGS = [case for case in ROUTINGS if case != "top1"]  # MC2 takes top-k 2..8
E2E_RUNS = {"fused": ["dispatcher=fused"], "domino": ["dispatcher=domino"],
            "domino_selective_ac": ["dispatcher=domino", "parallel.activation_checkpoint=selective"],
            "domino_full_ac": ["dispatcher=domino", "parallel.activation_checkpoint=full"],
            "dedup": ["dispatcher=dedup"],
            "dedup_selective_ac": ["dispatcher=dedup", "parallel.activation_checkpoint=selective"],
            "dedup_full_ac": ["dispatcher=dedup", "parallel.activation_checkpoint=full"],
            "capacity": ["dispatcher=capacity"]}
BF16_RUNS = ["eager", "fused", "domino", "dedup"]  # FSDP2 bf16 params: dtype handling of the custom autograd functions


# ----------------------------------------------------------------------------- the fake torch_npu

def _install_fake_npu() -> FakeTorchNpu:
    """The fake torch_npu (tests/fake_torch_npu.py) for the rest of this rank, on its GLUE contract: fp32 (the
    comparison with the local reference is exact) at ep2 with tiny rows; our limits relaxed alike. Each limit itself
    is tested in tests/test_npu_contract.py."""
    fake = install_torch_npu(FakeTorchNpu(GLUE))
    npu.hccl_comm_name = lambda group: group.group_name
    mc2.LIMITS = dataclasses.replace(mc2.LIMITS, dtypes=FLOATS, bytes_per_all_to_all=GLUE.mc2_bytes)
    npu_moe.PERMUTE_DTYPES = FLOATS
    return fake


def _on_fake_npu(experts: GroupedExperts, dispatcher: Dispatcher) -> None:
    """Run ``experts`` with the kernels the registry picks on an NPU: torch_npu's SwiGLU in its slot, and the
    dispatch path's torch_npu kernels for these CPU tensors while its dispatcher runs (only then: the reference
    it is compared with keeps the torch ones)."""
    kernels = select_kernels(KernelConfig(), "npu", Env("npu", has_torch_npu=True))
    experts.act_fn = kernels.get("packed_swiglu")

    def dispatch(*args: torch.Tensor) -> torch.Tensor:
        with installed_kernels(kernels, "cpu"):
            return dispatcher(*args)

    experts.dispatcher = dispatch


# ----------------------------------------------------------------------------- dispatch-level comparisons

def _dispatch_errors(rank: int, world_size: int, dispatchers: list[str], eps: list[int], routings: list[str]) -> dict:
    """{(dispatcher, ep, case, rank): errors}, gathered from every rank. Names ending in _npu run on the fake
    torch_npu (device_type='npu' on gloo)."""
    torch.manual_seed(0)
    reference = GroupedExperts(E, D, I)
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    errors = {}
    for ep in eps:
        ep_mesh = init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
        for name in dispatchers:
            sharded = copy.deepcopy(reference)
            apply_expert_parallel(sharded, ep_mesh, DispatcherConfig("eager" if name.endswith("_npu") else name))
            if name.endswith("_npu"):
                _on_fake_npu(sharded, dispatcher_class(name.removesuffix("_npu"))(ep_mesh.get_group(), E,
                                                                                   device_type="npu"))
            for case in routings:
                errors[(name, ep, case, rank)] = _errors(reference, sharded, ep_mesh, rank, case)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, errors)
    return {key: value for part in gathered for key, value in part.items()}


def _domino_schedule(ep_mesh) -> list[str]:
    """The order in which domino's backward sends gradients back and waits for them."""
    events, labels = [], iter(["dispatch 0", "dispatch 1", "combine 0", "combine 1"])  # forward creation order

    class Recorded:  # stands in for domino._Backward
        def __init__(self) -> None:
            self.label, self._grad = next(labels), None

        @property
        def grad(self):
            return self._grad

        @grad.setter
        def grad(self, value) -> None:
            events.append(f"{'send' if value is not None else 'wait'} {self.label}")
            self._grad = value

    torch.manual_seed(0)
    experts = GroupedExperts(E, D, I)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    apply_expert_parallel(experts, ep_mesh, DispatcherConfig("domino"))
    original, domino._Backward = domino._Backward, Recorded
    try:
        experts_NK = _experts_NK("random", ep_mesh.get_local_rank(), 2, seed=0)
        x_ND = torch.randn(len(experts_NK), D, requires_grad=True)
        experts(x_ND, experts_NK, torch.rand(len(experts_NK), K)).sum().backward()
    finally:
        domino._Backward = original
    return events


def _rows_sent(ep_mesh) -> list[dict]:
    """Per rank, on a top-4 routing (most tokens have several experts on each rank): the rows fused and dedup
    send to each rank in the dispatch, and receive in the combine (split sizes of the recorded all-to-alls of
    the hidden rows), with the routed slots and the distinct (token, rank) pairs to each rank."""
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    experts_NK = _experts_NK("top4", ep_rank, ep, seed=ep_rank)
    rank_NK = experts_NK // (E // ep)
    result = {"slots": [int((rank_NK == p).sum()) for p in range(ep)],
              "pairs": [int((rank_NK == p).any(1).sum()) for p in range(ep)]}
    for name, module in (("fused", fused), ("dedup", dedup)):
        calls, original = [], module.all_to_all_single_autograd

        def recording(x, output_split_sizes, input_split_sizes, group):
            if x.shape[1] == D:  # the hidden rows, not dedup's router weights
                calls.append((list(input_split_sizes), list(output_split_sizes)))
            return original(x, output_split_sizes, input_split_sizes, group)

        torch.manual_seed(0)
        experts = GroupedExperts(E, D, I)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.5)
        apply_expert_parallel(experts, ep_mesh, DispatcherConfig(name))
        module.all_to_all_single_autograd = recording
        try:
            experts(torch.randn(len(experts_NK), D), experts_NK, torch.rand(*experts_NK.shape))
        finally:
            module.all_to_all_single_autograd = original
        (dispatch_send, _), (_, combine_recv) = calls
        result[name] = {"dispatch": dispatch_send, "combine": combine_recv}
    gathered = [None] * ep
    dist.all_gather_object(gathered, result, group=ep_mesh.get_group())
    return gathered


def _two_rank_worker(rank: int, world_size: int, cfgs: dict) -> dict:
    """Everything that needs 2 ranks, in one spawn: domino's backward schedule, the rows fused and dedup send,
    mc2's refusal on gloo (and dedup's on NPU), the NPU paths on the fake torch_npu, and the end-to-end runs."""
    ep_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    result = {"device_type": group_device_type(ep_mesh.get_group()), "domino_schedule": _domino_schedule(ep_mesh),
              "rows_sent": _rows_sent(ep_mesh)}
    try:
        apply_expert_parallel(GroupedExperts(E, D, I), ep_mesh, DispatcherConfig("mc2"))
        result["mc2_on_cpu"] = "no error"
    except RuntimeError as error:
        result["mc2_on_cpu"] = str(error)
    fake = _install_fake_npu()
    try:  # torch_npu present, but the group is gloo: still no
        Mc2Dispatcher(ep_mesh.get_group(), E)
        result["mc2_on_cpu_with_torch_npu"] = "no error"
    except RuntimeError as error:
        result["mc2_on_cpu_with_torch_npu"] = str(error)
    try:
        DedupDispatcher(ep_mesh.get_group(), E, device_type="npu")
        result["dedup_on_npu"] = "no error"
    except NotImplementedError as error:
        result["dedup_on_npu"] = str(error)
    result["dispatch"] = _dispatch_errors(rank, world_size, ["fused_npu", "domino_npu", "mc2_npu"], [2], NPU_ROUTINGS)
    result["npu_calls"] = dict(fake.calls)
    del sys.modules["torch_npu"]
    result["train"] = {name: train.run(cfg) for name, cfg in cfgs.items()}
    return result


def _four_rank_worker(rank: int, world_size: int) -> dict:
    return _dispatch_errors(rank, world_size, ["fused", "domino", "dedup"], [4, 2], ROUTINGS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("dispatchers")
    eager = train_config(tmp_path, "ep2", 2, "dispatcher=eager", run="eager")
    write_inputs(tmp_path, dict(eager.model.arch))
    cfgs = {"eager": eager, **{name: train_config(tmp_path, "ep2", 2, *o, run=name) for name, o in E2E_RUNS.items()},
            **{f"{name}_bf16": train_config(tmp_path, "ep2", 2, f"dispatcher={name}", run=f"{name}_bf16",
                                            mixed_precision="bf16") for name in BF16_RUNS}}
    return run_distributed(_two_rank_worker, 2, cfgs)


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_four_rank_worker, 4)


def _check(errors: dict, name: str, ep: int, case: str, world: int) -> None:
    for rank in range(world):
        check_errors(errors[(name, ep, case, rank)], f"{name} rank {rank}")


@pytest.mark.parametrize("ep", [4, 2])
@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("name", ["fused", "domino", "dedup"])
def test_dispatcher_matches_local_dispatch_on_4_ranks(four_ranks, name, ep, case):
    _check(four_ranks, name, ep, case, 4)


@pytest.mark.parametrize("case", NPU_ROUTINGS)
@pytest.mark.parametrize("name", ["fused_npu", "domino_npu", "mc2_npu"])
def test_npu_paths_match_local_dispatch_on_fake_torch_npu(two_ranks, name, case):
    _check(two_ranks["dispatch"], name, 2, case, 2)


def test_npu_paths_call_the_torch_npu_ops(two_ranks):
    calls = two_ranks["npu_calls"]
    for op in ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul", "npu_swiglu",
               "npu_alltoallv_gmm", "npu_gmm_alltoallv"):
        assert calls.get(op, 0) > 0, op


def test_domino_backward_overlaps_each_half_s_experts_with_the_other_half_s_all_to_all(two_ranks):
    # Autograd runs ready nodes latest-created first; the forward's creation order makes backward send both
    # combine gradients, run experts-1 backward while combine-0's is in flight (between "wait combine 1" and
    # "wait combine 0"), send dispatch-1's, then run experts-0 backward while that one is in flight.
    assert two_ranks["domino_schedule"] == [
        "send combine 1", "send combine 0", "wait combine 1", "send dispatch 1", "wait combine 0",
        "send dispatch 0", "wait dispatch 1", "wait dispatch 0"]


def test_dedup_sends_one_row_per_token_and_rank(two_ranks):
    for rank, rows in enumerate(two_ranks["rows_sent"]):
        assert rows["dedup"]["dispatch"] == rows["dedup"]["combine"] == rows["pairs"], rank
        assert rows["fused"]["dispatch"] == rows["fused"]["combine"] == rows["slots"], rank
        crossing = {name: sum(rows[name]["dispatch"]) - rows[name]["dispatch"][rank] for name in ("fused", "dedup")}
        assert 0 < crossing["dedup"] < crossing["fused"], (rank, crossing)


def test_dedup_refuses_npu(two_ranks):
    assert two_ranks["dedup_on_npu"] == dedup.NOT_ON_NPU == "dispatcher=dedup runs on CUDA/CPU; on NPU use fused or mc2"


def test_mc2_refuses_to_build_off_npu(two_ranks):
    assert two_ranks["device_type"] == "cpu"
    assert two_ranks["mc2_on_cpu"] == two_ranks["mc2_on_cpu_with_torch_npu"] == mc2.NEEDS_NPU
    assert "needs an Ascend NPU with torch_npu" in mc2.NEEDS_NPU


@pytest.mark.parametrize("run", sorted(E2E_RUNS))
def test_dispatcher_trains_like_eager(two_ranks, run):
    eager, got = two_ranks["train"]["eager"], two_ranks["train"][run]
    assert [m["step"] for m in got] == [m["step"] for m in eager] == [1, 2, 3]
    for g, w in zip(got, eager):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), f"step {g['step']}"


@pytest.mark.parametrize("run", ["fused", "domino", "dedup"])
def test_dispatcher_trains_like_eager_in_bf16(two_ranks, run):
    eager, got = two_ranks["train"]["eager_bf16"], two_ranks["train"][f"{run}_bf16"]
    assert [m["step"] for m in got] == [m["step"] for m in eager] == [1, 2, 3]
    for g, w in zip(got, eager):
        # bf16 rounds in other places (eager: the weighted rows and each index_add; here the fp32-accumulated
        # bmm): eager bf16 itself is ~1e-4 (loss) and ~1e-2 (grad norm) off fp32 on this model.
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-3), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=3e-2), f"step {g['step']}"


# ----------------------------------------------------------------------------- selection logic, no ranks

def test_registry_builds_every_named_dispatcher():
    assert dispatcher_class("fused") is FusedDispatcher
    assert dispatcher_class("domino") is DominoDispatcher
    assert dispatcher_class("mc2") is Mc2Dispatcher
    assert dispatcher_class("dedup") is DedupDispatcher
    with pytest.raises(ValueError,
                       match=r"'deepep' is unknown; registered: capacity, dedup, domino, eager, fused, mc2$"):
        dispatcher_class("deepep")


def test_each_dispatcher_config_names_a_registered_dispatcher_and_back():
    # A new dispatcher is its module (registering itself) plus conf/dispatcher/<name>.yaml: the two sets agree.
    configs = {path.stem: path.read_text().splitlines() for path in Path(CONF_DIR, "dispatcher").glob("*.yaml")}
    assert set(configs) == set(DISPATCHERS)
    for name, lines in configs.items():
        assert lines[0].startswith("# ") and lines[1:] == [f"name: {name}"], name  # one documented line
        assert compose_config([f"dispatcher={name}"]).dispatcher.name == name


def test_an_unknown_dispatcher_fails_naming_the_registered_ones():
    with pytest.raises(MissingConfigException) as error:  # Hydra lists the group's options: the registered ones
        compose_config(["dispatcher=deepep"])
    assert all(f"\t{name}\n" in str(error.value) for name in DISPATCHERS), str(error.value)
    cfg = compose_config(["dispatcher.name=deepep"])
    with pytest.raises(ValueError, match=r"^dispatcher.name='deepep' is unknown; registered: capacity, dedup, domino, "
                                         r"eager, fused, mc2$"):
        validate(cfg)  # before any process group


def test_every_registered_dispatcher_implements_the_interface():
    interface = inspect.signature(Dispatcher.dispatch)
    for name, cls in DISPATCHERS.items():
        assert issubclass(cls, Dispatcher) and not inspect.isabstract(cls) and cls.name == name, name
        assert list(inspect.signature(cls.dispatch).parameters) == list(interface.parameters), name
        assert list(inspect.signature(cls.__init__).parameters) == ["self", "group", "num_experts", "device_type"]


def test_register_adds_a_dispatcher_and_refuses_a_taken_name_or_a_non_dispatcher(monkeypatch):
    monkeypatch.setattr(base, "DISPATCHERS", dict(DISPATCHERS))

    @base.register("echo")
    class Echo(Dispatcher):
        def dispatch(self, experts, x_ND, experts_NK, weights_NK):
            return x_ND

    assert base.dispatcher_class("echo") is Echo and Echo.name == "echo"
    with pytest.raises(ValueError, match=r"two dispatchers registered as 'eager': .*EagerDispatcher and .*Echo"):
        base.register("eager")(Echo)
    with pytest.raises(TypeError, match="must subclass parallelisms.dispatchers.base.Dispatcher"):
        base.register("plain")(object)


@pytest.mark.parametrize("overrides, expected", [([], "fused"), (["dispatcher=eager"], "eager"),
                                                 (["dispatcher=domino"], "domino"),
                                                 (["dispatcher=dedup"], "dedup"),
                                                 (["dispatcher=capacity"], "capacity")])
def test_parallelize_installs_the_dispatcher_group_s_dispatcher(overrides, expected):
    # What train.py passes: cfg.dispatcher next to cfg.parallel.
    assert installed_dispatchers(compose_config(["parallel=ep2", *overrides])) == {DISPATCHERS[expected]}


def installed_dispatchers(cfg) -> set[type]:
    """The dispatchers parallelize installs for ``cfg`` on rank 1 of a fake 4-rank group, which builds the real
    meshes (the model on meta: nothing communicates)."""
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        dims = build_parallel_dims(cfg.parallel, 4, 1, "cpu")
        spec = models.get_spec("qwen3_moe")
        with torch.device("meta"):
            model = spec.model_cls(debug_model_args())
        parallelize_qwen3_moe(model, spec, dims, cfg.parallel, torch.float32, torch.float32, cfg.dispatcher)
        return {type(block.get_submodule(spec.experts).dispatcher) for block in model.get_submodule(spec.blocks)}
    finally:
        dist.destroy_process_group()


# Which local kernels run on NPU (torch_npu's permutes and grouped matmul, the loop for an expert without rows)
# is the kernel registry's choice: tests/test_kernels.py.


# ----------------------------------------------------------------------------- GPU only: host syncs per layer

def _sync_count_worker(rank: int, world_size: int) -> dict[str, int]:
    """Host syncs in one forward + backward of a MoE layer's dispatch on CUDA (bf16, NCCL), after a warm-up."""
    ep_mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("ep",))
    install(select_kernels(KernelConfig(), "cuda"))  # as a run does: torch._grouped_mm, Triton gathers
    counts = {}
    for name in ("eager", "fused", "domino", "dedup", "capacity"):
        torch.manual_seed(0)
        experts = GroupedExperts(8, 64, 32).to("cuda", torch.bfloat16)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.1)
        apply_expert_parallel(experts, ep_mesh, DispatcherConfig(name))
        x_ND = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        weights_NK, experts_NK = torch.rand(256, 8, device="cuda").topk(2, dim=-1)

        def step():
            experts(x_ND, experts_NK, weights_NK.to(torch.bfloat16)).float().square().sum().backward()

        step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchronizing" in str(w.message) for w in caught)
    return counts


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fused_domino_and_dedup_sync_the_host_once_per_layer_on_gpu():
    counts = run_distributed(_sync_count_worker, 2, backend="nccl")
    # The one sync: all_to_all_single's split sizes as Python ints. (eager also pays torch.bincount's two.)
    assert counts["fused"] == counts["domino"] == counts["dedup"] == 1, counts
    assert counts["capacity"] == 0, counts  # equal static splits: none at all
