"""Run a function on N local processes joined in one process group (gloo on CPU, or nccl with one GPU per
rank), under pytest.

``run_distributed(fn, world_size, *args)`` spawns the ranks, calls ``fn(rank, world_size, *args)`` in each
and returns rank 0's return value. A failure in any rank fails the calling test with that rank's
traceback; a hang fails it after ``timeout_s``. Start-up (importing torch in every child) costs a few
seconds per spawn, so a test should do all its work for one world size in one call. By default the ranks are forked
from a server process that imported torch once instead (each spawned rank spends ~2.4 s of CPU importing it; a
forked one ~0.3 s): for 16 ranks on 2 cores that is ~20 s less per call.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, result_path: str, backend: str,
            env: dict[str, str], args: tuple) -> None:
    os.environ.clear()  # the caller's environment now (a forked rank would have the fork server's, from its start)
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # N ranks share 2 cores
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120),
                            device_id=device_id)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, result_path)
        dist.barrier()  # no rank tears down while a peer still talks to it (a gloo peer can abort then)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 300, fork_server: bool = True) -> Any:
    """``fn`` must be importable (a module-level function): the ranks are spawned, or forked from a server, never
    from the caller. fork_server: the ranks are forks of one server process that imported train (and with it
    torch) and ``fn``'s module, and has run nothing: a rank inherits fresh imports, never the caller's threads or
    state, and gets the caller's environment variables. The server starts at the first such call of the session,
    with that call's ``fn``. fork_server=False spawns fresh interpreters (for what only a process start reads, such
    as glibc's MALLOC_* variables, or a CUDA run)."""
    if fork_server:
        # train first: multiprocessing silently skips a preload that fails to import, as fn's module can in the
        # server (seen for a test module under pytest), and then every rank would import torch itself.
        mp.set_forkserver_preload(["train", fn.__module__])
    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "result.pt")
        context = mp.start_processes(_worker, args=(fn, world_size, _free_port(), result_path, backend,
                                                     dict(os.environ), args),
                                     nprocs=world_size, join=False,
                                     start_method="forkserver" if fork_server else "spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout_s:.0f} s")
        return torch.load(result_path, weights_only=True)


# ----------------------------------------------------------------------------- the debug model and its loop

DEBUG_ARCH = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  router_aux_loss_coef=0.01)


def run_train(rank: int, world_size: int, cfg: Any) -> list[dict]:
    """A rank of ``run_distributed`` that runs train.run(cfg): for tests whose own module cannot be a rank's (one
    importing transformers before tests.conftest has set its import of ``kernels`` right)."""
    import train

    return train.run(cfg)


def fsdp_param_groups(state) -> list:
    """An FSDP unit's parameter groups (private state): ``_fsdp_param_groups`` from torch 2.13, one
    ``_fsdp_param_group`` (or None) before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g] if (g := state._fsdp_param_group) is not None else []
    return groups


def debug_model_args(**overrides: Any):
    from models import build_args

    return build_args("qwen3_moe", {**DEBUG_ARCH, **overrides})


def seeded_weights(args, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full weights of the debug model, initialised by one process: what every layout loads."""
    from models import get_spec

    torch.manual_seed(seed)
    model = get_spec("qwen3_moe").model_cls(args)
    model.init_weights()
    return {k: v.clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into plain or DTensor parameters: distribute_tensor slices a full tensor for any
    placements, _StridedShard (FSDP over EP's Shard(0)) included, without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        full = weights[name]
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)


def synthetic_batches(steps: int, global_batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[steps, global_batch, seq_len + 1] token ids."""
    return torch.randint(0, vocab_size, (steps, global_batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))


def loss_share(model: torch.nn.Module, dims, tokens_GT1: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global loss on its dp slice of the global batch, normalised as train.py does
    (by the global token count; the aux loss from globally reduced routing counts)."""
    from training.loss import router_loss_shares

    rows = tokens_GT1.shape[0] // dims.dp
    tokens_BT1 = tokens_GT1[dims.dp_rank * rows:(dims.dp_rank + 1) * rows]
    labels_BT = tokens_BT1[:, 1:]
    out = model(tokens_BT1[:, :-1], labels_BT=labels_BT)
    ce = out.loss_sum / labels_BT.numel() / dims.dp
    args = model.args
    aux, _ = router_loss_shares(out.router_stats, args.num_experts, dims.data_group)
    return ce + args.router_aux_loss_coef * aux


def train_steps(model: torch.nn.Module, dims, tokens_SGT1: torch.Tensor, lr: float = 1e-2,
                max_norm: float = 0.5, micro_batches: int = 1, autocast: torch.autocast | None = None,
                fused: bool | None = None, optimizer: torch.optim.Optimizer | None = None) -> list[dict[str, float]]:
    """The training step of train.py in a few lines: loss share, backward with grad_scale, cross-mesh
    clipping, AdamW; returns the global loss and grad norm of every step. ``micro_batches``: each step's batch
    in that many chunks, one backward each on its part of the share; ``autocast``: around each forward;
    ``fused``: AdamW's (its fused kernel bumps no version counter of the parameters it updates); ``optimizer``:
    another one over the model's parameters instead."""
    from contextlib import nullcontext

    from parallelisms import clip_grad_norm_

    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=fused)
    history = []
    for step, tokens_GT1 in enumerate(tokens_SGT1, 1):
        share = 0.0
        for tokens in tokens_GT1.chunk(micro_batches):
            with autocast or nullcontext():
                part = loss_share(model, dims, tokens) / micro_batches
            (part * dims.grad_scale).backward()
            share = share + part.detach()
        grad_norm = clip_grad_norm_(model, max_norm, dims)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dims.data_group is not None:
            dist.all_reduce(share, group=dims.data_group)
        history.append({"step": step, "loss": share.item(), "grad_norm": grad_norm.item()})
    return history


def assert_same_curve(got: list[dict], want: list[dict], steps: list[int] | None = None) -> None:
    """Every step of ``got`` has the loss and grad norm ``want`` has at that step (rel 1e-4: layouts differ only in
    summation order); ``steps``: exactly these steps were logged."""
    import pytest

    if steps is not None:
        assert [m["step"] for m in got] == steps
    want_by_step = {m["step"]: m for m in want}
    assert got and all(g["step"] in want_by_step for g in got)
    for g in got:
        w = want_by_step[g["step"]]
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-4), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {g['step']}"
