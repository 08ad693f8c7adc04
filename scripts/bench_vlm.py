"""Vision-language throughput on one device: Qwen3.5-35B-A3B shapes cut to --layers layers with the published vision
tower (conf/model/qwen35_moe.yaml: the vision_config of Qwen3.5-35B-A3B's config.json), synthetic images and chat
text, bf16 compute with fp32 master weights and bf16 AdamW moments (both rows: this repository's AdamW).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python scripts/bench_vlm.py --layers 4 --seq-len 1024 \
        --local-batch 2 --images 2 --image-size 448 --steps 12 kernel_config=auto_fla

(docs/results.md's row, one H100: at --seq-len 2048 ours and transformers run out of memory on 80 GB.)

Rows, each in a process of its own (one that runs out of memory leaves the others), on the same windows:

- ``ours``: this trainer's step as train.py runs it (``prepare_batches``, ``train.train_step``: forward, backward,
  gradient norm and clip, AdamW) with the images: tokens/s, peak memory, and the vision tower's share of the step:
  its forward + backward alone on the step's images (device events, after the timed steps) over the step time.
- ``text``: the same windows with every image's tokens replaced by text ids, no images (``model.vision=false``):
  the text model alone.
- ``transformers``: ``Qwen3_5MoeForConditionalGeneration`` of the same config (its own kernels: FLA where
  installed; on a Hopper GPU with triton 3.4-3.7.0, with the same #640-safe backward step as ours: FLA refuses its
  own there), each decoder layer, each vision block and the root an FSDP2 unit over the one rank (bf16 compute, fp32
  reduction), its loss from ``labels``, torch's gradient clipping, the same AdamW, on the same windows and images.

A window: each of --local-batch rows of --seq-len tokens is one conversation (``<|im_start|>user`` with --images
images of --image-size pixels square and random text, then the assistant's random text; ids drawn below the
tokenizer's 248,044), its images' tokens and position ids as the loader yields them (the 3-D rope positions from
transformers' ``get_rope_index``), the labels those of the text (-100 where the target is a vision token). Pixel
values are random (the tower's cost does not depend on them). Token ids for the data are drawn with --seed.
Extra train.py overrides (``kernel_config=auto_fla``, ``parallel.activation_checkpoint=full``) go to the ours and text
rows; ``--hf-checkpointing`` turns on transformers' gradient checkpointing.

On a CPU (``--device cpu --model qwen35_moe_debug --image-size 64``) it runs the same rows in seconds, in fp32: a
smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = ("ours", "text", "transformers")
IM_START, IM_END, NEWLINE = 248045, 248046, 198  # Qwen3.5's <|im_start|>, <|im_end|> and "\n"


def import_transformers_then_ours() -> None:
    """transformers (5.25+) imports the PyPI package ``kernels`` at import time, whose name is also this repository's
    ``kernels/``: import it first, with the repository off sys.path, then put the repository first (what transformers
    imported it keeps under its own names). docs/huggingface.md#checking-an-export-beside-a-current-transformers."""
    os.environ.setdefault("USE_HUB_KERNELS", "NO")  # transformers' own torch code, not kernels from the hub
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() not in (REPO, REPO / "scripts")]
    import transformers.integrations.hub_kernels  # noqa: F401
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401

    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        del sys.modules[name]
    sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------ the windows
def windows(args: argparse.Namespace, vision, text_only: bool) -> list[dict]:
    """--steps windows of --local-batch conversations (the same for every row: drawn from --seed)."""
    import functools
    import types

    import torch
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=types.SimpleNamespace(
        spatial_merge_size=vision.spatial_merge_size)))
    fake.get_vision_position_ids = functools.partial(Qwen3_5MoeModel.get_vision_position_ids, fake)
    side = args.image_size // vision.patch_size
    side -= side % vision.spatial_merge_size
    grid = (1, side, side)
    tokens = side * side // vision.merge_unit
    g = torch.Generator().manual_seed(args.seed)
    T, out = args.seq_len, []
    vision_ids = torch.tensor([vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id])

    def text(n: int) -> list[int]:
        return torch.randint(0, 248044, (n,), generator=g).tolist()

    for _ in range(args.steps):
        rows, grids = [], []
        for _ in range(args.local_batch):
            user = [IM_START, *text(1), NEWLINE]
            for _ in range(args.images):
                user += [vision.vision_start_token_id, *[vision.image_token_id] * tokens, vision.vision_end_token_id]
                grids.append(grid)
            user += [*text(16), IM_END, NEWLINE, IM_START, *text(1), NEWLINE]
            if len(user) + 2 > T:
                raise SystemExit(f"--images {args.images} of --image-size {args.image_size} take {len(user)} tokens: "
                                 f"more than --seq-len {T}")
            rows.append(user + text(T - len(user) - 1) + [IM_END])
        ids = torch.tensor(rows)
        is_vision = torch.isin(ids, vision_ids)
        grid_A3 = torch.tensor(grids)
        pixels = torch.randn(int(grid_A3.prod(1).sum()), vision.patch_dim, generator=g)
        replaced = torch.where(is_vision, torch.randint(0, 248044, ids.shape, generator=g), ids)  # drawn either way
        if text_only:  # the same conversations with text where the images were
            labels = torch.cat([replaced[:, 1:], torch.full((len(rows), 1), -100)], 1)
            out.append({"input_ids": replaced, "labels": labels,
                        "position_ids": torch.arange(T).expand(len(rows), T)})
            continue
        labels = torch.cat([ids[:, 1:], torch.full((len(rows), 1), -100)], 1)
        labels[torch.cat([is_vision[:, 1:], torch.zeros(len(rows), 1, dtype=torch.bool)], 1)] = -100
        rope, _ = Qwen3_5MoeModel.get_rope_index(fake, ids, (ids == vision.image_token_id).int(),
                                                 image_grid_thw=grid_A3)
        text_row = torch.arange(T).expand(1, *ids.shape)
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.cat([text_row, rope]),
                    "pixel_values": pixels, "image_grid_thw": grid_A3})
    return out


# ------------------------------------------------------------------------------------------ the rows
def train_config(args: argparse.Namespace, vision: bool, out: Path):
    from hydra import compose, initialize_config_dir

    from training.config import register_schema, to_train_config

    register_schema()
    overrides = [f"model={args.model}", f"model.arch.num_hidden_layers={args.layers}", f"model.vision={vision}",
                 f"data.seq_len={args.seq_len}", f"train.local_batch_size={args.local_batch}",
                 f"train.steps={args.steps}", f"train.device={args.device}", "optim.state_dtype=bfloat16",
                 "optim.warmup_steps=0", f"train.output_dir={out}", *args.extra]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return to_train_config(compose(config_name="config", overrides=overrides))


def run_ours(args: argparse.Namespace, vision: bool) -> dict:
    """This trainer's step on the windows: train.py's model build and step, without its loader and logs."""
    import torch

    import train
    from core import device
    from training.batch import prepare_batches
    from training.optim import Schedule, build_optimizer, build_update
    from training.startup import World, plan_run

    with tempfile.TemporaryDirectory() as tmp:
        cfg = train_config(args, vision, Path(tmp) / "run")
        plan = plan_run(cfg, World.of(cfg.launch))
        dims, dev = train.start_processes(cfg, plan)
        torch.manual_seed(0)
        model, (total, _), _ = train.build_model(plan, dims, dev)
    optimizer = build_optimizer(model, cfg.optim)
    update = build_update(optimizer, model, cfg.optim.grad_clip)
    schedule = Schedule(optimizer, cfg.optim, cfg.train.steps)
    autocast = torch.autocast(plan.dev_type, enabled=False)  # the one-rank plan casts, as FSDP's policy would
    data = windows(args, plan.model_args.vision_config or vision_args(args), text_only=not vision)

    def step(window: dict) -> float:
        batches = prepare_batches([window], plan.model_args, dims.cp_rank, dims.cp, dev, mtp=False)
        return train.train_step(model, batches, update, schedule, cfg, dims, plan.model_args, autocast, apply=True,
                                routing=False).loss

    seconds, losses = timed(step, data, args.warmup, plan.dev_type)
    row = {"tokens_per_s": args.local_batch * args.seq_len / seconds, "step_ms": 1e3 * seconds,
           "peak_gib": device.peak_memory_gib(plan.dev_type), "params": total, "loss": losses[-1]}
    if vision:
        batch, = prepare_batches([data[-1]], plan.model_args, dims.cp_rank, dims.cp, dev, mtp=False)
        row["vision_ms"] = 1e3 * tower_seconds(model.visual, batch.images, plan.dev_type)
        row["vision_share"] = row["vision_ms"] / row["step_ms"]
        row["patches"] = int(batch.images.pixel_values_JY.shape[0])
    return row


def vision_args(args: argparse.Namespace):
    """The preset's vision tower (for the text row's windows: the same conversations)."""
    import models

    cfg = train_config(args, True, Path(tempfile.gettempdir()) / "unused")
    return models.build_args(cfg.model.model_type, dict(cfg.model.arch), vision=True).vision_config


def timed(step, data: list[dict], warmup: int, dev_type: str) -> tuple[float, list[float]]:
    """Mean seconds per step over the steps after ``warmup`` (each step's one host read paces the loop, as in
    train.py), and every step's loss."""
    from core import device

    losses = []
    for window in data[:warmup]:
        losses.append(step(window))
    device.synchronize(dev_type)
    device.reset_peak_memory(dev_type)
    begin = time.perf_counter()
    for window in data[warmup:]:
        losses.append(step(window))
    device.synchronize(dev_type)
    return (time.perf_counter() - begin) / max(len(data) - warmup, 1), losses


def tower_seconds(tower, images, dev_type: str, iters: int = 5) -> float:
    """The vision tower's forward and backward alone on ``images`` (its gradients discarded), per call."""
    import torch

    from core import device

    def once() -> None:
        tokens = tower(images)
        tokens.backward(torch.ones_like(tokens))

    for _ in range(2):
        once()
    device.synchronize(dev_type)
    begin = time.perf_counter()
    for _ in range(iters):
        once()
    device.synchronize(dev_type)
    seconds = (time.perf_counter() - begin) / iters
    for p in tower.parameters():
        p.grad = None
    return seconds


def run_transformers(args: argparse.Namespace) -> dict:
    """transformers' model under FSDP2 over one rank on the same windows."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import models
    from core import device
    from kernels.registry import Env
    from models.hf_io import _hf_names
    from training.optim import AdamW

    cfg = train_config(args, True, Path(tempfile.gettempdir()) / "unused")
    margs = models.build_args(cfg.model.model_type, dict(cfg.model.arch), vision=True)
    if "full_attention" not in margs.resolved_layer_types():  # its mask code needs one such layer's cache
        raise SystemExit(f"--layers {args.layers}: transformers' Qwen3.5 runs only with a full-attention layer among "
                         f"them (one in every {margs.full_attention_interval}): use --layers "
                         f">= {margs.full_attention_interval}")
    dev_type = "cpu" if args.device == "cpu" else "cuda"
    fla_step = same_fla_backward(Env.detect(dev_type))
    dev = torch.device(dev_type, 0) if dev_type != "cpu" else torch.device("cpu")
    if not dist.is_initialized():  # FSDP2 over one rank
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        dist.init_process_group("gloo" if dev_type == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1, **({} if dev_type == "cpu" else {"device_id": dev}))
    config = transformers.Qwen3_5MoeConfig(**_hf_names(models.get_spec("qwen3_5_moe")).config_from_arch(margs))
    config.text_config.output_router_logits = True  # its loss with the router aux loss, as ours
    torch.manual_seed(0)
    with torch.device(dev):  # initialised where it trains (on meta its rotary buffers would be left empty)
        hf = transformers.Qwen3_5MoeForConditionalGeneration(config)
    bf16 = dev_type != "cpu"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else torch.float32, reduce_dtype=torch.float32)
    for layer in [*hf.model.language_model.layers, *hf.model.visual.blocks]:
        fully_shard(layer, mp_policy=mp)
    fully_shard(hf, mp_policy=mp)
    if args.hf_checkpointing:
        hf.gradient_checkpointing_enable()
    hf.train()
    params = [p for p in hf.parameters() if p.requires_grad]
    optimizer = AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
                       {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=cfg.optim.lr,
                      betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, state_dtype=torch.bfloat16)
    data = windows(args, margs.vision_config, text_only=False)

    def step(window: dict) -> float:
        ids = window["input_ids"].to(dev)
        # transformers shifts the labels itself: the unshifted labels are the ids, -100 at vision tokens
        labels = torch.where(torch.isin(ids, torch.tensor([margs.vision_config.image_token_id,
                                                           margs.vision_config.vision_start_token_id,
                                                           margs.vision_config.vision_end_token_id], device=dev)),
                             -100, ids)
        out = hf(input_ids=ids, position_ids=window["position_ids"].to(dev), labels=labels,
                 pixel_values=window["pixel_values"].to(dev), image_grid_thw=window["image_grid_thw"].to(dev))
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.item()

    seconds, losses = timed(step, data, args.warmup, dev_type)
    return {"tokens_per_s": args.local_batch * args.seq_len / seconds, "step_ms": 1e3 * seconds,
            "peak_gib": device.peak_memory_gib(dev_type), "loss": losses[-1],
            "params": sum(p.numel() for p in hf.parameters()), **({"fla": fla_step} if fla_step else {})}


def same_fla_backward(env) -> str | None:
    """On a Hopper GPU with a Triton of FLA #640 (torch 2.11's 3.6), FLA refuses its gated ``chunk_bwd_dqkwg`` and
    transformers' model could not train; our model runs that one step through FLA's backend registry
    (``kernels.linear_attention.fla.chunk_gated_delta_rule_hopper_safe``). Register the same backend here, so that
    both rows run the same kernels, every other one FLA's own; say so in the row (None: nothing registered).
    ``env``: ``kernels.registry.Env.detect``'s."""
    from kernels.linear_attention import fla

    if env.device_type != "cuda" or env.fla_version is None \
            or fla.chunk_backward_broken(env.triton_version, env.capability) is None:
        return None
    fla.register_hopper_dqkwg()
    return f"FLA with this repository's #640-safe chunk_bwd_dqkwg (triton {env.triton_version}), as ours"


# ------------------------------------------------------------------------------------------ the table
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35_moe", help="a Qwen3.5 preset with a vision_config")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--local-batch", type=int, default=2)
    parser.add_argument("--images", type=int, default=2, help="images per conversation")
    parser.add_argument("--image-size", type=int, default=448, help="pixels, square (448: 28 x 28 patches, 196 tokens)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="train.device: auto | cuda | cpu (a smoke test)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which of {', '.join(ROWS)}")
    parser.add_argument("--hf-checkpointing", action="store_true", help="transformers' gradient checkpointing")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # one row, in this process
    parser.add_argument("--out", type=Path, help="write the rows here as JSON (default: print only)")
    parser.add_argument("extra", nargs="*", help="train.py overrides for the ours and text rows")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_intermixed_args(argv)
    if args.row is not None:  # a child: one row, its result as the last line
        import_transformers_then_ours()
        result = run_transformers(args) if args.row == "transformers" else run_ours(args, args.row == "ours")
        print("BENCH_VLM_ROW " + json.dumps(result), flush=True)
        return
    rows = {}
    for row in args.rows.split(","):
        if row not in ROWS:
            raise SystemExit(f"--rows: {row!r} is not one of {', '.join(ROWS)}")
        child = argv if argv is not None else sys.argv[1:]  # the child runs --row alone
        proc = subprocess.run([sys.executable, __file__, *child, "--row", row], cwd=REPO, capture_output=True,
                              text=True)
        found = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_VLM_ROW ")]
        if proc.returncode != 0 or not found:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rows[row] = {"error": " / ".join(tail) or f"exit code {proc.returncode}"}
        else:
            rows[row] = json.loads(found[-1].removeprefix("BENCH_VLM_ROW "))
        print(f"{row}: {rows[row]}", flush=True)
    print(f"\n{args.model} x {args.layers} layers, {args.local_batch} x {args.seq_len} tokens, {args.images} images of "
          f"{args.image_size}^2 per row, mean over steps {args.warmup + 1}..{args.steps}, extra: {args.extra}")
    print("| row | tokens/s | step ms | vision tower ms (share) | peak GiB | final loss |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | | |")
            continue
        tower = f"{r['vision_ms']:.1f} ({r['vision_share']:.1%}) over {r['patches']:,} patches" if "vision_ms" in r \
            else "-"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {tower} | {r['peak_gib']:.1f} | "
              f"{r['loss']:.3f} |")
    for name, r in rows.items():
        if "fla" in r:
            print(f"{name}: {r['fla']}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
