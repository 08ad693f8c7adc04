"""Host memory of loading a Hugging Face checkpoint into a sharded model (per-rank reads vs full reads), and with
``--save`` of writing the final weights from one (streamed vs a whole-model gather on every rank).

    python scripts/measure_load_memory.py --world 4 --ep 4 --experts 64 --hidden 1024 --layers 4
    python scripts/measure_load_memory.py --save --world 4 --ep 4 --experts 32 --hidden 768 --layers 4

On ``--world`` gloo ranks, each case in fresh processes: build the model on meta, parallelize it, materialise
it, then run the case and print each rank's peak RSS growth during it (VmHWM reset just before).

Load (a random Qwen3-MoE checkpoint, fp32, written first): ``load_hf_into_model`` (each rank reads only its
slices) vs ``load_hf_state_dict`` + ``load_into_model`` (each rank reads everything).

Save (random weights): ``save_model_weights`` (parameters gathered one at a time, rank 0 streams each to the
file) vs the way it was before (``full_state_dict`` on every rank, then rank 0 writes it with ``save_file``);
and ``export_hf`` (streamed the same way, per-expert names, sharded).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as `python scripts/measure_load_memory.py`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import parallelisms  # noqa: E402
from models import build_args, get_spec  # noqa: E402
from models.hf_io import export_hf, load_hf_into_model, load_hf_state_dict, load_into_model  # noqa: E402
from parallelisms.config import BackendConfig, ParallelConfig  # noqa: E402
from core.files import atomic_write  # noqa: E402
from training.checkpoint import full_state_dict, save_model_weights  # noqa: E402

LOADS = {"sliced": "load_hf_into_model (own slices)", "full": "load_hf_state_dict + load_into_model (all)"}
SAVES = {"streamed": "save_model_weights (streamed, one tensor at a time)",
         "gathered": "before: full_state_dict on every rank + save_file on rank 0",
         "export_hf": "export_hf (streamed, per-expert names, 1 GiB shards)"}


def status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_case(model: torch.nn.Module, case: str, directory: Path, rank: int) -> None:
    if case == "sliced":
        load_hf_into_model(model, directory / "hf")
    elif case == "full":
        load_into_model(model, load_hf_state_dict(directory / "hf"))
    elif case == "streamed":
        save_model_weights(model, directory / "model.safetensors", is_writer=rank == 0)
    elif case == "gathered":  # save_model_weights before it streamed
        tensors = full_state_dict(model)
        if rank == 0:
            atomic_write(directory / "model.safetensors",
                         lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    elif case == "export_hf":
        export_hf(model, "qwen3_moe", directory / "hf-export", max_shard_bytes=2**30)


def worker(rank: int, world: int, port: int, arch: dict, directory: str, ep: int, case: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = ParallelConfig(name="m", ep_size=ep, backend=BackendConfig(name="fsdp2"))
    dims = parallelisms.build_parallel_dims(cfg, world, rank, "cpu")
    spec, args = get_spec("qwen3_moe"), build_args("qwen3_moe", arch)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = parallelisms.parallelize_qwen3_moe(model, spec, dims, cfg, torch.float32, torch.float32,
                                               parallelisms.DispatcherConfig("eager"))
    model.to_empty(device="cpu")
    if case in SAVES:
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().normal_()  # resident pages, as trained weights are
    dist.barrier()
    reset_peak()
    before = status_gib("VmRSS")
    run_case(model, case, Path(directory), rank)
    growth = [None] * world
    dist.all_gather_object(growth, status_gib("VmHWM") - before)
    if rank == 0:
        Path(out).write_text(" ".join(f"{g:.2f}" for g in growth))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", action="store_true", help="measure the final save instead of the load")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    arch = dict(vocab_size=32000, hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=opts.hidden // 8, num_experts=opts.experts, num_experts_per_tok=4,
                moe_intermediate_size=opts.hidden // 2)
    with torch.device("meta"):
        model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", arch))
    size_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    largest_gib = max(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    print(f"model: {size_gib:.2f} GiB fp32 (largest tensor {largest_gib:.2f} GiB); {opts.world} gloo ranks, "
          f"ep {opts.ep}; one rank's share ~ {size_gib / opts.world:.2f} GiB")
    with tempfile.TemporaryDirectory() as tmp:
        if not opts.save:
            model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", arch))
            model.init_weights()
            export_hf(model, "qwen3_moe", Path(tmp) / "hf", max_shard_bytes=2**30)
        del model
        for case, how in (SAVES if opts.save else LOADS).items():
            out = Path(tmp) / "growth.txt"
            mp.spawn(worker, args=(opts.world, free_port(), arch, tmp, opts.ep, case, str(out)), nprocs=opts.world)
            growth = [float(g) for g in out.read_text().split()]
            print(f"{how}: peak RSS growth per rank {', '.join(f'{g:.2f}' for g in growth)} GiB "
                  f"(worst {max(growth):.2f})")


if __name__ == "__main__":
    main()
