"""Plan a run on paper: per-GPU memory, the bytes of every collective of a step and a predicted step time, for a
model, layout and number of GPUs, on the CPU in about a second (the model is built on the meta device).

    python scripts/plan.py model=qwen3_moe_235b_a22b parallel=ep8 data.seq_len=4096 train.local_batch_size=2 \\
        plan.gpus=64
    python scripts/plan.py model=qwen35_moe_397b_a17b data.seq_len=4096 train.local_batch_size=1 plan.gpus=256 \\
        plan.sweep=true

Takes train.py's overrides (the same Hydra config) plus ``plan.*`` (``training.planner.PlanConfig``: gpus (by
default launch.nproc_per_node where set, else the smallest world the layout needs; the first line says which),
gpus_per_node, nvlink_gb_s, internode_gb_s, a2a_gb_s, tflops, hbm_gb_s, capacity_gib, sweep; with model.vision=true
image_token_share and image_patches). What the numbers
assume and where they were checked against the H200s: docs/scaling.md. After the plan of one layout, the setting of
its EP exchange the planner would choose (dispatcher, e4m3 dispatch, checkpointing that keeps the exchange), and why.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.config import register_schema, to_train_config  # noqa: E402
from training.launch import one_line_errors  # noqa: E402
from training.planner import GiB, Plan, PlanConfig, advise, default_world, fits, plan, sweep  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def read_args(argv: list[str]):
    """train.py's config from the Hydra overrides, and the PlanConfig from the ``plan.*`` ones (unknown keys fail)."""
    plan_overrides = [a.removeprefix("plan.") for a in argv if a.startswith("plan.")]
    register_schema()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = to_train_config(compose(config_name="config",
                                          overrides=[a for a in argv if not a.startswith("plan.")]))
    except HydraException as e:  # an override Hydra cannot parse or compose: one line, as train.py's own CLI
        raise ValueError(f"{str(e).splitlines()[0]} (arguments are train.py's overrides and plan.KEY=VALUE; "
                         "python scripts/plan.py --help)") from e
    unknown = sorted({o.split("=")[0] for o in plan_overrides} - set(PlanConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"plan has unknown keys {unknown}; known: {sorted(PlanConfig.__dataclass_fields__)}")
    machine = OmegaConf.merge(OmegaConf.structured(PlanConfig), OmegaConf.from_dotlist(plan_overrides))
    return cfg, OmegaConf.to_object(machine)


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def print_plan(p: Plan, machine: PlanConfig, checkpoint: str) -> None:
    s, m = p.sizes, p.memory
    print(f"world {s.world_size} = dp {s.dp} x cp {s.cp}; experts: ep {s.ep} x efsdp {s.efsdp} x edp {s.edp}; "
          f"FSDP over {s.mp_shard}" + (f", replicated {s.mp_replicate}x" if s.mp_replicate > 1 else "")
          + f"; {p.tokens_per_gpu:,} tokens per GPU per step\n")
    print("| memory per GPU | GiB |\n|---|---|")
    for name, value in [("parameters (fp32 shards)", m.params), ("gradients (fp32 shards)", m.grads),
                        ("AdamW moments (fp32 shards)", m.optimizer),
                        *((f"activations, checkpointing {mode}" + (" (configured)" if mode == checkpoint else ""),
                           a) for mode, a in m.activations.items()),
                        ("routed-row gradients and all-to-all buffers (one layer)", m.routed_buffers),
                        ("chunked LM head (one chunk of logits, kept gradients)", m.lm_head),
                        ("FSDP buffers (gathered, prefetched, reduce-scatter)", m.fsdp_buffers)]:
        print(f"| {name} | {gib(value)} |")
    verdict = "fits" if fits(p, machine) else "does NOT fit"
    print(f"| **peak** (at the {m.peak_phase}) | **{gib(m.peak)}** ({verdict} in {machine.capacity_gib:g} GiB) |\n")
    print("| collective | mesh | what | calls/step | GB/step (all ranks) | ms/step | hidden behind compute |")
    print("|---|---|---|---|---|---|---|")
    for c in p.collectives:
        print(f"| {c.kind} | {c.mesh} | {c.what} | {c.calls} | {c.bytes / 1e9:.3f} | {c.seconds * 1e3:.1f} | "
              f"{'no' if c.exposed else 'yes'} |")
    print(f"\nstep: compute {p.compute_s * 1e3:.0f} ms at {machine.tflops:g} TFLOP/s + optimizer "
          f"{p.optimizer_s * 1e3:.0f} ms + exposed communication = {p.step_s * 1e3:.0f} ms -> "
          f"{p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU")


def print_sweep(plans, machine: PlanConfig) -> None:
    print("| layout | ep | cp | checkpointing | peak GiB | fits | tokens/s/GPU |\n|---|---|---|---|---|---|---|")
    for cfg, p in plans:
        print(f"| {cfg.parallel.name} | {p.sizes.ep} | {p.sizes.cp} | {cfg.parallel.activation_checkpoint} | "
              f"{gib(p.memory.peak)} | {'yes' if fits(p, machine) else 'no'} | {p.tokens_per_s_per_gpu:,.0f} |")


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    with one_line_errors():
        cfg, machine = read_args(sys.argv[1:])
        if not machine.gpus:
            machine.gpus, why = default_world(cfg)
            print(f"plan.gpus not given: planning for {machine.gpus} GPUs, {why} (plan.gpus=N plans another)\n")
        if machine.sweep:
            print_sweep(sweep(cfg, machine), machine)
        else:
            print_plan(plan(cfg, machine), machine, cfg.parallel.activation_checkpoint)
            print()
            print("\n".join(advise(cfg, machine)))


if __name__ == "__main__":
    main()
