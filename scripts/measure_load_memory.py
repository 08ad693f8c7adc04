"""Host memory of loading a Hugging Face checkpoint into a sharded model: per-rank reads vs full reads.

    python scripts/measure_load_memory.py --world 4 --parallel ep4 --experts 64 --hidden 1024 --layers 4

Writes a random Qwen3-MoE checkpoint (fp32), then on ``--world`` gloo ranks builds the model on meta,
parallelizes it, materialises it and loads the checkpoint twice in fresh processes: with
``load_hf_into_model`` (each rank reads only its slices) and with ``load_hf_state_dict`` +
``load_into_model`` (each rank reads everything). Prints each rank's peak RSS growth during the load.
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

import parallelisms  # noqa: E402
from models import build_args, get_spec  # noqa: E402
from models.hf_io import export_hf, load_hf_into_model, load_hf_state_dict, load_into_model  # noqa: E402
from parallelisms.config import BackendConfig, ParallelConfig  # noqa: E402


def status_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank: int, world: int, port: int, arch: dict, hf_dir: str, ep: int, sliced: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = ParallelConfig(name="m", ep_size=ep, backend=BackendConfig(name="fsdp2"))
    dims = parallelisms.build_parallel_dims(cfg, world, rank, "cpu")
    spec, args = get_spec("qwen3_moe"), build_args("qwen3_moe", arch)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model = parallelisms.parallelize_model(model, spec, dims, cfg, torch.float32, torch.float32,
                                           parallelisms.DispatcherConfig("eager"))
    model.to_empty(device="cpu")
    reset_peak()
    before = status_gib("VmRSS")
    if sliced:
        load_hf_into_model(model, hf_dir)
    else:
        load_into_model(model, load_hf_state_dict(hf_dir))
    growth = torch.tensor([status_gib("VmHWM") - before])
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(f"{growth.item():.2f}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    arch = dict(vocab_size=32000, hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=8,
                num_key_value_heads=4, head_dim=opts.hidden // 8, num_experts=opts.experts, num_experts_per_tok=4,
                moe_intermediate_size=opts.hidden // 2)
    with tempfile.TemporaryDirectory() as tmp:
        model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", arch))
        model.init_weights()
        size_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        export_hf(model, "qwen3_moe", Path(tmp) / "hf", max_shard_bytes=2**30)
        del model
        print(f"checkpoint: {size_gib:.2f} GiB fp32; {opts.world} gloo ranks, ep {opts.ep}; "
              f"one rank's share ~ {size_gib / opts.world:.2f} GiB")
        for sliced in (True, False):
            out = Path(tmp) / "growth.txt"
            mp.spawn(worker, args=(opts.world, free_port(), arch, str(Path(tmp) / "hf"), opts.ep, sliced, str(out)),
                     nprocs=opts.world)
            how = "load_hf_into_model (own slices)" if sliced else "load_hf_state_dict + load_into_model (all)"
            print(f"{how}: peak RSS growth of the worst rank during the load {out.read_text()} GiB")


if __name__ == "__main__":
    main()
