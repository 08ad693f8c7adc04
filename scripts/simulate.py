"""Will my N-GPU job fit, and how fast will it run? Run one of its ranks on this GPU and predict the job.

    python scripts/simulate.py model=qwen3_moe_30b_a3b parallel=ep8 data.seq_len=4096 train.local_batch_size=2 \\
        parallel.activation_checkpoint=selective optim.state_dtype=bfloat16 sim.world=64

Takes train.py's overrides plus ``sim.*`` (world: the job's ranks; rank: which one, default 0; steps: trained,
default 8, the last two profiled; routing: balanced (default: ``model.arch.router_force_balance``, the loopback's
case) or learned; data: random (default: random token ids, no documents) or config (the configured data); out: the
simulation's directory, new or empty (default: a temporary one); links: on (default) or off; a2a_gb_s: the
all-to-all's rate inside a node, default the calibrated one of docs/scaling.md: 160 with the links emulated, 130
with them off; comm_sms: the SMs an emulated all-to-all occupies, default 24; ring_sms: those an emulated ring
(FSDP's collectives) occupies, default 24; advise: on (default) or off, the planner's choice for the job) and
``plan.*`` (the machine: nvlink_gb_s, internode_gb_s, gpus_per_node; scripts/plan.py). train.py runs as rank
``sim.rank`` of the job under the loopback world (``launch.simulate_world``, parallelisms/loopback.py): the real
rank's shards, prefetch chains, dispatcher and kernels, every collective a local copy.

With ``sim.links=on`` (``launch.links.emulate``) every collective also runs where NCCL runs it, on its process
group's own stream, and holds that stream for its time on the links (its bytes over sim.a2a_gb_s for an all-to-all
inside a node, plan.nvlink_gb_s for FSDP's rings inside a node, plan.internode_gb_s across nodes), in a kernel on
sim.comm_sms SMs; the caller waits where NCCL's would. So what the exchanges cost, and what of them the compute hides
(FSDP's prefetch, domino's halves), is measured: the prediction is the measured step.

With ``sim.links=off`` the collectives are copies alone and the prediction is arithmetic on the measurement:

    step = measured step - the all-to-all copies (they stand in for the EP / CP exchanges, on the compute stream)
           + the planner's time on the links for the exposed exchanges (EP and CP all-to-alls; inside a node at
             sim.a2a_gb_s)
           + whatever of FSDP's all-gathers and reduce-scatters the compute does not hide

under balanced routing, with the planner's link speeds (docs/scaling.md). Printed: peak memory measured and
planned, the step and its profile, the bytes and link time of each collective, the compute's rate (the trainer's
FLOP count, as torchtitan's), the predicted tokens/s/GPU beside the paper plan's, and the setting the planner would
choose for this job (``training.planner.advise``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan import read_args  # noqa: E402

from core import device  # noqa: E402
from training.launch import one_line_errors  # noqa: E402
from parallelisms.links import A2A_GB_S, A2A_GB_S_EMULATED, COMM_SMS  # noqa: E402
from training.planner import FULL_CHECKPOINT_RECOMPUTE, RECOMPUTING_MODES, GiB, advise, plan  # noqa: E402
from training.run_dir import RECORD_FILE  # noqa: E402

SIM_KEYS = {"world": 8, "rank": 0, "steps": 8, "routing": "balanced", "data": "random", "out": "",
            "links": "on", "a2a_gb_s": 0.0, "comm_sms": COMM_SMS, "ring_sms": COMM_SMS,
            "advise": "on"}  # a2a_gb_s 0: as sim.links
# What each key holds, for the line that refuses a value.
_MEANING = {"world": "the simulated job's ranks", "rank": "which of them this process is",
            "steps": "steps trained, the last two profiled", "a2a_gb_s": "GB/s of the all-to-all inside a node",
            "comm_sms": "the SMs an emulated all-to-all occupies",
            "ring_sms": "the SMs an emulated ring collective (FSDP's all-gathers, reduce-scatters) occupies"}


def sim_args(argv: list[str]) -> tuple[dict, list[str]]:
    """The ``sim.*`` settings, checked (each refusal one line naming the key and the fix), and the other arguments."""
    sim, rest, given = dict(SIM_KEYS), [], set()
    for arg in argv:
        if not arg.startswith("sim."):
            rest.append(arg)
            continue
        key, eq, value = arg.removeprefix("sim.").partition("=")
        given.add(key)
        if key not in SIM_KEYS:
            raise ValueError(f"sim has no key {key!r}; known: {sorted(SIM_KEYS)}")
        if not eq:
            raise ValueError(f"sim.{key} needs a value: sim.{key}=<value> (python scripts/simulate.py --help)")
        kind = type(SIM_KEYS[key])
        try:
            sim[key] = kind(value)
        except ValueError:
            raise ValueError(f"sim.{key}={value} must be {'an integer' if kind is int else 'a number'} "
                             f"({_MEANING[key]})") from None
    if "a2a_gb_s" not in given:  # each model's own calibrated rate: the emulation's, or the paper's
        sim["a2a_gb_s"] = A2A_GB_S_EMULATED if sim["links"] == "on" else A2A_GB_S
    checks = [
        (sim["world"] >= 1, f"sim.world={sim['world']} must be >= 1 ({_MEANING['world']}, e.g. sim.world=8)"),
        (0 <= sim["rank"] < sim["world"], f"sim.rank={sim['rank']} must be in [0, sim.world={sim['world']})"),
        (sim["steps"] >= 2, f"sim.steps={sim['steps']} must be >= 2: the last two steps are profiled and timed (the "
                            "steps after the third are timed where there are more; e.g. sim.steps=6)"),
        (sim["a2a_gb_s"] > 0, f"sim.a2a_gb_s={sim['a2a_gb_s']} must be > 0 ({_MEANING['a2a_gb_s']})"),
        (sim["routing"] in ("balanced", "learned"), f"sim.routing={sim['routing']} must be balanced or learned"),
        (sim["data"] in ("random", "config"), f"sim.data={sim['data']} must be random or config"),
        (sim["links"] in ("on", "off"), f"sim.links={sim['links']} must be on (each collective held for its link "
                                        "time) or off (copies alone, the link time added on paper)"),
        (sim["comm_sms"] >= 1, f"sim.comm_sms={sim['comm_sms']} must be >= 1 ({_MEANING['comm_sms']})"),
        (sim["ring_sms"] >= 1, f"sim.ring_sms={sim['ring_sms']} must be >= 1 ({_MEANING['ring_sms']})"),
        (sim["advise"] in ("on", "off"), f"sim.advise={sim['advise']} must be on (the planner's choice for the job, "
                                         "a few seconds) or off"),
    ]
    for ok, line in checks:
        if not ok:
            raise ValueError(line)
    return sim, rest


def _simulated_run(run_dir: Path) -> bool:
    """Whether ``run_dir``'s record says it is a simulation's run (``launch.simulate_world``)."""
    try:
        return bool(json.loads((run_dir / RECORD_FILE).read_text()).get("simulated"))
    except (OSError, ValueError, AttributeError):
        return False


def check_out(out: Path) -> None:
    """``sim.out`` must be a new or empty directory outside any training run: a simulation writes its tokens, its
    run and its report there, and must not mix them into a run of the trainer, a user's folder or an earlier
    simulation (which is not resumed: a simulated run writes no checkpoint)."""
    for parent in out.resolve().parents:
        if (parent / RECORD_FILE).is_file() and not _simulated_run(parent):
            raise ValueError(f"sim.out={out} is inside the training run {parent} (its {RECORD_FILE}): the simulation "
                             "would write into that run; give sim.out a new directory outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"sim.out={out} is a file, not a directory; give sim.out a new or empty directory")
    held = sorted(p.name for p in out.iterdir())
    listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if not held:
        return
    if (out / "simulation.json").is_file() or _simulated_run(out / "run"):
        raise ValueError(f"sim.out={out} holds an earlier simulation ({listed}), which a simulation neither resumes "
                         "nor overwrites: give sim.out a new directory, or remove that one first")
    if (out / RECORD_FILE).is_file() or (out / "config.yaml").is_file():
        raise ValueError(f"sim.out={out} is a training run's directory ({listed}): the simulation would write into "
                         "that run; give sim.out a new or empty directory")
    raise ValueError(f"sim.out={out} is not empty ({listed}) and holds no simulation; give sim.out a new or empty "
                     "directory")


@contextlib.contextmanager
def output_dir(given: str) -> Iterator[Path]:
    """The simulation's directory: ``sim.out`` (checked, ``check_out``) or a new temporary one. A simulation that
    fails leaves nothing behind: what it made is removed (the directory itself where it made it)."""
    if given:
        out = Path(given)
        check_out(out)
        made = next((p for p in [*reversed(out.absolute().parents), out.absolute()] if not p.exists()), None)
        out.mkdir(parents=True, exist_ok=True)
    else:
        out = made = Path(tempfile.mkdtemp(prefix="simulate-"))
    try:
        yield out
    except BaseException:
        if made is not None:  # the first directory on the way that the simulation made
            shutil.rmtree(made, ignore_errors=True)
        else:
            for p in out.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
        raise


def main(argv: list[str]) -> dict:
    sim, rest = sim_args(argv)
    with output_dir(sim["out"]) as out:
        report = simulate(sim, rest, out)
    print(f"simulation written to {out} (simulation.json; the run and its profile in {out / 'run'})")
    return report


def simulate(sim: dict, rest: list[str], out: Path, advice: bool = True) -> dict:
    """Run the rank (train.py in this process) and write and print its report, which it returns; ``advice``: with
    the planner's choice for the job (``training.planner.advise``)."""
    given = sorted({a.split("=")[0] for a in rest if a.lstrip("+~").startswith("launch.links.")})
    if given:
        raise ValueError(f"{', '.join(given)}: scripts/simulate.py sets the links from sim.links, sim.a2a_gb_s, "
                         "sim.comm_sms, sim.ring_sms and plan.nvlink_gb_s / plan.internode_gb_s / plan.gpus_per_node")
    steps = sim["steps"]
    overrides = [*rest, f"launch.simulate_world={sim['world']}", f"launch.simulate_rank={sim['rank']}",
                 f"train.steps={steps}", "train.save_final=false", f"train.output_dir={out / 'run'}",
                 f"logging.profile_step={steps - 1}", "logging.profile_steps=2", "logging.tensorboard=false",
                 *(["model.arch.router_force_balance=true"] if sim["routing"] == "balanced" else [])]
    cfg, machine = read_args(overrides)
    if sim["links"] == "on":
        overrides += ["launch.links.emulate=true", f"launch.links.a2a_gb_s={sim['a2a_gb_s']}",
                      f"launch.links.comm_sms={sim['comm_sms']}", f"launch.links.ring_sms={sim['ring_sms']}",
                      f"launch.links.nvlink_gb_s={machine.nvlink_gb_s}",
                      f"launch.links.internode_gb_s={machine.internode_gb_s}",
                      f"launch.links.gpus_per_node={machine.gpus_per_node}"]
    if sim["data"] == "random":  # every step's global batch (the loader windows the whole job's data)
        tokens = out / "tokens.npy"
        sequences = cfg.train.local_batch_size * cfg.train.grad_accum_steps * sim["world"] // cfg.parallel.cp_size
        need = (steps + 1) * sequences * (cfg.data.seq_len + 1)
        np.save(tokens, np.random.default_rng(0).integers(0, cfg.model.arch["vocab_size"], size=need, dtype=np.int32))
        overrides += ["data=tokens", f"data.path={tokens}", f"data.cache_dir={out / 'cache'}"]
    cfg, machine = read_args(overrides)
    machine = dataclasses.replace(machine, gpus=sim["world"])
    paper = plan(cfg, machine)
    # The exchanges' time at the calibrated all-to-all rate (FSDP's rings keep the link's)
    calibrated = plan(cfg, dataclasses.replace(machine, nvlink_gb_s=min(machine.nvlink_gb_s, sim["a2a_gb_s"])))

    import train  # noqa: PLC0415 (after the arguments are known good: importing torch's stack takes seconds)
    from parallelisms import loopback  # noqa: PLC0415

    loopback.HELD.clear()
    history = train.run(cfg)
    profile = json.loads((out / "run" / "profile" / f"summary_rank{sim['rank']}.json").read_text())
    if sim["links"] == "on":
        held = collections.Counter()
        for (kind, _), seconds in loopback.HELD.items():
            held[kind] += seconds / len(history)
        report = emulated(cfg, paper, history, profile, calibrated, dict(held))
    else:
        report = predict(cfg, paper, history, profile, calibrated)
    report["advice"] = []
    if advice and sim["advise"] == "on":
        try:
            report["advice"] = advise(cfg, dataclasses.replace(machine, a2a_gb_s=sim["a2a_gb_s"]))
        except ValueError as e:  # a variant the planner refuses must not lose the measurement
            report["advice"] = [f"choice for the exchange: not planned ({e})"]
    (out / "simulation.json").write_text(json.dumps(report, indent=1))
    print_report(report, sim)
    return report


def _timed_step_s(history: list[dict]) -> float:
    """The median step time after the first two steps (warm-up) and before the last (profiled) ones."""
    timed = [m for m in history if m["step"] >= 3 and m["step"] < len(history) - 1] or history[-2:]
    return float(np.median([m["step_time_s"] for m in timed]))


def _measured(cfg, paper, history: list[dict], profile: dict) -> dict:
    """What both predictions report of the rank and its plan."""
    tokens = paper.tokens_per_gpu
    return {
        "world": paper.sizes.world_size, "layout": cfg.parallel.name, "dispatcher": cfg.dispatcher.name,
        "tokens_per_gpu": tokens, "peak_gib": max(m["peak_mem_gib"] for m in history),
        "planned_peak_gib": paper.memory.peak / GiB, "planned_peak_phase": paper.memory.peak_phase,
        "step_s": _timed_step_s(history), "plan_tokens_per_s_per_gpu": paper.tokens_per_s_per_gpu,
        "profile": profile, "final_loss": history[-1]["loss"],
        "collectives": [{"kind": c.kind, "mesh": c.mesh, "what": c.what, "calls": c.calls,
                         "bytes_per_gpu": c.bytes // paper.sizes.world_size, "link_s": c.seconds, "exposed": c.exposed}
                        for c in paper.collectives],
    }


def _rates(cfg, tokens: int, history: list[dict], seconds: float) -> dict:
    """The step's FLOP rate over ``seconds``: as the trainer counts (torchtitan's), and executed (full
    checkpointing's second forward counted; selective: what it recomputes depends on the ops, so none), and MFU."""
    recompute = (FULL_CHECKPOINT_RECOMPUTE if cfg.parallel.activation_checkpoint in RECOMPUTING_MODES
                 else {"none": 1.0}.get(cfg.parallel.activation_checkpoint))
    flops = tokens * history[-1]["tflops_per_device"] * 1e12 / history[-1]["tokens_per_s_per_device"]
    peak = device.peak_tflops(cfg.train.device if cfg.train.device != "auto" else device.device_type())
    return {"compute_tflops": flops / seconds / 1e12,
            # torchtitan's count leaves out full checkpointing's second forward (1 of the 3 parts): what ran counts it
            "executed_tflops": flops * recompute / seconds / 1e12 if recompute else None,
            "mfu": flops / seconds / (peak * 1e12) if peak else None}


def emulated(cfg, paper, history: list[dict], profile: dict, calibrated, held: dict[str, float]) -> dict:
    """The prediction with the links emulated (``sim.links=on``): the measured step itself. Beside it the link time
    held per step by collective kind (``held``), the planner's at the same rates (exposed, hidden), and the compute's
    rate while the GPU computes (the profile's busy time)."""
    r = _measured(cfg, paper, history, profile)
    busy_s = profile["busy_ms"] / 1e3
    r.update({"links": "emulated", "predicted_step_s": r["step_s"],
              "predicted_tokens_per_s_per_gpu": r["tokens_per_gpu"] / r["step_s"], "busy_s": busy_s,
              "held_link_s": held, "planned_exposed_link_s": sum(c.seconds for c in calibrated.collectives if c.exposed),
              "planned_hidden_link_s": sum(c.seconds for c in calibrated.collectives if not c.exposed),
              **_rates(cfg, r["tokens_per_gpu"], history, busy_s if busy_s > 0 else r["step_s"])})
    return r


def predict(cfg, paper, history: list[dict], profile: dict, calibrated) -> dict:
    """The prediction with the links off (``sim.links=off``, see the module docstring): with the exposed exchanges
    at the calibrated all-to-all rate, and at the planner's NVLink rate (the link's, an upper bound)."""
    r = _measured(cfg, paper, history, profile)
    step_s = r["step_s"]
    a2a_s = profile["loopback_ms"].get("all_to_all", 0.0) / 1e3
    compute_s = step_s - a2a_s
    hidden_s = sum(c.seconds for c in paper.collectives if not c.exposed)

    def job_step(p) -> tuple[float, float]:
        exposed = sum(c.seconds for c in p.collectives if c.exposed)
        return exposed, compute_s + exposed + max(0.0, hidden_s - compute_s)

    exposed_s, predicted_s = job_step(calibrated)
    link_exposed_s, link_step_s = job_step(paper)
    tokens = paper.tokens_per_gpu
    r.update({"links": "off", "a2a_copies_s": a2a_s, "compute_s": compute_s,
              **_rates(cfg, tokens, history, compute_s),
              "exposed_link_s": exposed_s, "hidden_link_s": hidden_s, "predicted_step_s": predicted_s,
              "predicted_tokens_per_s_per_gpu": tokens / predicted_s,
              "at_link_rate_tokens_per_s_per_gpu": tokens / link_step_s, "link_exposed_s": link_exposed_s})
    return r


def print_report(r: dict, sim: dict) -> None:
    p = r["profile"]
    print(f"\nrank {sim['rank']} of {r['world']} ({r['layout']}, dispatcher {r['dispatcher']}, routing "
          f"{sim['routing']}, {r['tokens_per_gpu']:,} tokens per GPU per step)")
    print(f"peak memory: {r['peak_gib']:.1f} GiB measured, {r['planned_peak_gib']:.1f} planned "
          f"({r['planned_peak_phase']})")
    if r["links"] == "emulated":
        print(f"step: {r['step_s']:.3f} s measured with the links emulated (all-to-all inside a node at "
              f"sim.a2a_gb_s={sim['a2a_gb_s']:g}, sim.comm_sms={sim['comm_sms']}, sim.ring_sms={sim['ring_sms']}); "
              f"profiled: compute busy "
              f"{p['busy_ms']:.1f} ms, idle {p['idle_ms']:.1f} ms of {p['wall_ms']:.1f}")
        print("link time held per step: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(r["held_link_s"].items()))
              + f" (the plan at these rates: exposed {r['planned_exposed_link_s'] * 1e3:.1f} ms, behind compute "
              f"{r['planned_hidden_link_s'] * 1e3:.1f} ms)")
    else:
        print(f"step: {r['step_s']:.3f} s measured = compute {r['compute_s']:.3f} s + all-to-all copies "
              f"{r['a2a_copies_s']:.3f} s; profiled: busy {p['busy_ms']:.1f} ms, idle {p['idle_ms']:.1f} ms of "
              f"{p['wall_ms']:.1f}")
    print("kernel time by category (ms/step): " + ", ".join(f"{k} {v:.1f}" for k, v in
                                                         sorted(p["categories_ms"].items(), key=lambda kv: -kv[1])))
    print("loopback collectives (copies and link holds, ms/step): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["loopback_ms"].items())))
    print("| collective | mesh | what | calls | MiB per GPU | link ms (plan) | exposed (plan) |\n|---|---|---|---|---|---|---|")
    for c in r["collectives"]:
        print(f"| {c['kind']} | {c['mesh']} | {c['what']} | {c['calls']} | {c['bytes_per_gpu'] / 2**20:,.1f} | "
              f"{c['link_s'] * 1e3:.1f} | {'yes' if c['exposed'] else 'behind compute'} |")
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    executed = (f"; {r['executed_tflops']:.0f} executed, counting full checkpointing's second forward"
                if r["executed_tflops"] and r["executed_tflops"] != r["compute_tflops"] else "")
    print(f"compute: {r['compute_tflops']:.0f} TFLOP/s ({mfu} MFU{executed})"
          + (" while a compute kernel runs" if r["links"] == "emulated" else ""))
    if r["links"] == "emulated":
        print(f"predicted: {r['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (the measured step, links "
              f"emulated); paper plan alone: {r['plan_tokens_per_s_per_gpu']:,.0f}")
    else:
        print(f"predicted: {r['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s/GPU (step {r['predicted_step_s']:.3f} s "
              f"= compute + exposed links {r['exposed_link_s'] * 1e3:.1f} ms + unhidden FSDP "
              f"{max(0.0, r['hidden_link_s'] - r['compute_s']) * 1e3:.1f} ms, all-to-all at sim.a2a_gb_s="
              f"{sim['a2a_gb_s']:g}); at the link's rate: {r['at_link_rate_tokens_per_s_per_gpu']:,.0f}; paper plan "
              f"alone: {r['plan_tokens_per_s_per_gpu']:,.0f}")
    for line in r.get("advice", []):
        print(line)


if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        sys.exit(0)
    with one_line_errors():
        main(sys.argv[1:])
