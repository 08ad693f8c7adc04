"""Processes: run a Hydra job on several local processes (``python train.py launch.nproc_per_node=8
parallel=ep8`` re-launches itself under torchrun with the same overrides, so Hydra multirun sweeps (``-m``) run
each job as its own torchrun, one after another), and end a failed run with one readable line.

Errors: bad input and refused actions (``ONE_LINE_ERRORS``) end the process with ``error: <message>`` and exit
code 1 instead of a traceback; ``HYDRA_FULL_ERROR=1`` re-raises them with their tracebacks. Under torchrun the
message also goes to torchrun's per-child error file, so torchrun's failure summary shows it, and the relaunching
process prints the first failed child's message as its own one line (the children stay quiet). A child killed by
a signal is named with the signal and the checkpoint that resumes the run; the other children's gloo errors about
their lost peer are one line each in torchrun's error files, not tracebacks. Ctrl-C (KeyboardInterrupt) ends with
``interrupted: <message>`` and exit code 130. SIGTERM (or SIGHUP) to the launching process: torchrun passes it on to
the children, which stop with a checkpoint, and the launcher ends with one line naming it, exit code 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback

from parallelisms.dispatchers import DISPATCHERS, dispatcher_class
from parallelisms.links import LinkConfig, link_errors
from training.checkpoint import CheckpointError, complete_checkpoints

_RELAUNCHED = "QWEN_MOE_RELAUNCHED"  # set for the children of relaunch_with_torchrun


class LaunchError(RuntimeError):
    """A torchrun job started by relaunch_with_torchrun failed; the message is its first failure's."""


# yaml.YAMLError: a config file YAML cannot read (a syntax error, or a !!python tag, which no loader here constructs)
ONE_LINE_ERRORS = (ValueError, OSError, ImportError, FloatingPointError, CheckpointError, LaunchError, yaml.YAMLError)


def yaml_line(e: yaml.YAMLError) -> str:
    """A YAML error as one line: the file, line and column, and the problem (YAML's own message spans lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f"{mark.name} line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    if "tag:yaml.org,2002:python/" in problem:
        problem += (" (a tag that builds a Python object, which no config here may do: refused, nothing was run); "
                    "the trainer writes no such tag: restore the file, or remove the tag")
    return where + problem


@dataclass
class LaunchConfig:
    nproc_per_node: int = 1  # > 1 and not already under torchrun: re-launch this job with torchrun
    # > 0: run in this one process as rank simulate_rank of a simulate_world-rank job whose peers are copies of it
    # (parallelisms/loopback.py; docs/scaling.md): the real job's per-rank work, timed on one device
    simulate_world: int = 0
    simulate_rank: int = 0
    # The links the simulated job's collectives take (parallelisms/links.py): emulated in the loopback world's
    # collectives when launch.links.emulate (scripts/simulate.py turns it on), else the collectives are copies alone
    links: LinkConfig = field(default_factory=LinkConfig)


def needs_torchrun(cfg: LaunchConfig) -> bool:
    return cfg.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ


def simulation_errors(launch: LaunchConfig, writes: dict[str, str], dispatcher: str) -> list[str]:
    """What a loopback simulation (launch.simulate_world) cannot do, each as the line that refuses it. ``writes``:
    the keys set to write (or resume) a checkpoint, weights or an export, each with the value that turns it off. A
    simulated checkpoint would hold one rank of N, its peers' shards being copies of its own. ``launch.links`` is
    checked here too, in one place (``parallelisms.links.link_errors``). ``dispatcher``:
    dispatcher.name, refused where its class declares the loopback cannot stand in for its exchange
    (``Dispatcher.unsimulated``)."""
    n, r = launch.simulate_world, launch.simulate_rank
    errors = link_errors(launch.links)
    if n == 0:
        return errors + ([] if r == 0 else [f"launch.simulate_rank={r} needs launch.simulate_world (the simulated "
                                            "job's ranks)"]) + (
            ["launch.links.emulate=true needs launch.simulate_world (the links of a loopback simulation's job)"]
            if launch.links.emulate else [])
    if not 0 <= r < n:
        errors.append(f"launch.simulate_world={n}, launch.simulate_rank={r}: need 0 <= simulate_rank < simulate_world")
    if launch.nproc_per_node > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        errors.append(f"launch.simulate_world={n} runs in one process: not with launch.nproc_per_node > 1 or under "
                      "torchrun")
    unsimulated = dispatcher_class(dispatcher).unsimulated
    if unsimulated:
        simulated = ", ".join(name for name, cls in sorted(DISPATCHERS.items()) if not cls.unsimulated)
        errors.append(f"dispatcher={dispatcher} {unsimulated}: launch.simulate_world cannot simulate it; use a "
                      f"dispatcher it can ({simulated})")
    if writes:
        errors.append(f"launch.simulate_world={n}: a simulated run writes no checkpoint, weights or export and "
                      f"resumes none (each would hold one rank of {n}); set "
                      + " ".join(f"{key}={off}" for key, off in writes.items()))
    return errors


SWEEP_FAILURES: list[str] = []  # the failed jobs of this process's Hydra sweep (one_line_errors, SweepSummary)


@contextlib.contextmanager
def one_line_errors(sweep_job: str | None = None) -> Iterator[None]:
    """Turn ONE_LINE_ERRORS into ``error: <message>`` and exit code 1 (see the module docstring). ``sweep_job``: this
    is that job of a Hydra sweep (``sweep_job_name``): its line names it, and the sweep goes on to its next job
    (``SweepSummary`` ends it with the jobs that failed)."""
    try:
        yield
    except KeyboardInterrupt as e:  # Ctrl-C (train.py's StopSignal says how far it got): one line, exit code 130
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if not os.environ.get(_RELAUNCHED) and int(os.environ.get("RANK", 0)) == 0:
            print(f"interrupted: {e or 'Ctrl-C'}", file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1" or not (isinstance(e, ONE_LINE_ERRORS) or _lost_peer(e)):
            raise
        message = (str(e) if isinstance(e, (LaunchError, CheckpointError)) else
                   f"{_LOST_PEER_LINE}: {str(e).splitlines()[0]}" if _lost_peer(e) else
                   f"{type(e).__name__}: {yaml_line(e)}" if isinstance(e, yaml.YAMLError) else
                   f"{type(e).__name__}: {e}")
        if sweep_job is not None:
            message = f"sweep job {sweep_job}: {message}"
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torchrun reads it; its summary then shows this message instead of a bare exit code
            Path(error_file).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
        if not os.environ.get(_RELAUNCHED) and int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {message}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr, flush=True)
        if sweep_job is None:
            sys.exit(1)
        SWEEP_FAILURES.append(sweep_job)


def sweep_job_name(hydra_cfg: Any) -> str | None:
    """``#<job number> (<the overrides of this job that the sweep varies>)`` in a Hydra sweep, else None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    given = [arg for arg in sys.argv[1:] if "=" in arg and not arg.startswith("-")]  # the sweep as it was typed
    swept = {o.key_or_group for o in OverridesParser.create().parse_overrides(given) if o.is_sweep_override()}
    chosen = [o for o in hydra_cfg.overrides.task if o.lstrip("+~").split("=")[0] in swept]
    return f"#{hydra_cfg.job.num} ({' '.join(chosen)})"


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml): a sweep (``-m``) whose jobs failed ends with one line naming them, exit code
    1. Each failed job wrote its own line, and the sweep went on with the others: without this, the first failure
    ended the sweep, and the jobs after it never ran without a word."""

    def __init__(self) -> None:
        self.jobs = 0

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        self.jobs += 1

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if SWEEP_FAILURES:
            print(f"error: {len(SWEEP_FAILURES)} of the sweep's {self.jobs} jobs failed, each said why above: "
                  f"{', '.join(SWEEP_FAILURES)}; the others finished", file=sys.stderr, flush=True)
            sys.exit(1)


# How gloo reports a peer whose process died mid-collective: the survivors' side of a killed rank, which the
# launcher reports (failure_line), not a bug of theirs to show a traceback for.
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer")
_LOST_PEER_LINE = "lost a peer rank (its process ended)"  # how such a rank's one line starts


def _written_message(failure: Any) -> str:
    """What a failed rank wrote to its error file ({"message", "timestamp"}: ``one_line_errors``), or '' where it
    wrote none: torchrun then keeps {"message": "<NONE>"} as the file's data and makes a message up ("Signal 6
    (SIGABRT) received by PID ...")."""
    data = failure.error_file_data
    return data["message"] if "timestamp" in data and isinstance(data.get("message"), str) else ""


def _lost_peer(e: Exception) -> bool:
    return isinstance(e, RuntimeError) and "WORLD_SIZE" in os.environ and any(m in str(e) for m in _LOST_PEER)


def relaunch_with_torchrun(cfg: LaunchConfig, overrides: list[str], run_dir: str, config: tuple[str, str],
                           checkpoints: Path) -> None:
    """Run ``train.py <overrides>`` under torchrun on this node with the same primary config (``config``: its
    directory and name), writing into this job's run directory; a failure raises LaunchError with the first failed
    child's message, or, when a child was killed by a signal, which one and how (and the checkpoint under
    ``checkpoints`` that resumes)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    script = Path(__file__).resolve().parents[1] / "train.py"
    config_dir, config_name = config
    args = ["--standalone", f"--nproc_per_node={cfg.nproc_per_node}", str(script), f"--config-path={config_dir}",
            f"--config-name={config_name}", *overrides, f"train.output_dir={hydra_quoted(run_dir)}"]
    print("launching: torchrun", " ".join(args), flush=True)
    os.environ[_RELAUNCHED] = "1"
    # The agent's own logs (rendezvous, worker start/stop, per-child failure dumps) would bury the one line.
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    try:
        run(parse_args(args))
    except ChildFailedError as e:
        raise LaunchError(failure_line(e.failures, checkpoints)) from None
    except SignalException as e:  # torchrun passed the signal on to the children, which stop with a checkpoint
        saved = complete_checkpoints(checkpoints)
        resume = (f"; the newest checkpoint is {saved[-1]}: train.resume=auto continues from it" if saved else
                  "; no checkpoint was saved")
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt(f"Ctrl-C: the torchrun job stopped{resume}") from None
        print(f"stopped on {e.sigval.name}: torchrun passed it on to the ranks{resume}", file=sys.stderr, flush=True)
    finally:
        del os.environ[_RELAUNCHED]
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def hydra_quoted(value: str) -> str:
    """``value`` as one quoted value of a Hydra override, read back as it is: a run directory's name may hold a quote,
    a space, '=' or ','. In Hydra's quoted strings a quote is escaped with a backslash, and so is a run of backslashes
    before a quote or the closing one."""
    value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
    return "'" + value.replace("'", "\\'") + "'"


def failure_line(failures: dict, checkpoints: Path) -> str:
    """One line for a failed torchrun job (``failures``: ChildFailedError's, rank -> ProcessFailure), naming the
    cause, not its consequences: once one rank fails torchrun stops the others with SIGTERM (one may then abort,
    SIGABRT, on the way out) and the survivors of a killed rank lose their peer. So, in this order: a rank that
    failed with its own error (its exit code, or a signal that reached it after it wrote the error: ranks that
    fail together can abort each other on the way out); a rank killed by a signal, with the checkpoint that
    resumes the run; a rank that only lost its peer; torchrun's SIGTERM (the job itself was stopped). Within
    each, the earliest."""

    def order(rank: int) -> tuple[int, int]:
        f, written = failures[rank], _written_message(failures[rank])
        if written:  # however it then exited: a lost peer's rank may abort (SIGABRT) on its way out
            return (2 if written.startswith(_LOST_PEER_LINE) else 0), f.timestamp
        if f.exitcode == -signal.SIGTERM:
            return 3, f.timestamp
        return (1 if f.exitcode < 0 else 0), f.timestamp

    rank = min(failures, key=order)
    failure = failures[rank]
    message = _written_message(failure)
    if message and failure.exitcode < 0:
        return f"rank {rank} of the torchrun job failed: {message}"
    if failure.exitcode < 0:
        code = -failure.exitcode
        newest = complete_checkpoints(checkpoints)
        resume = (f"train.resume=auto continues from the last checkpoint, {newest[-1]}" if newest else
                  f"no checkpoint was written under {checkpoints}; train.resume=auto starts the run again")
        return (f"rank {rank} of the torchrun job was killed by {signal.Signals(code).name} (signal {code}); the "
                f"other ranks were stopped with it; {resume}")
    message = message or "its traceback is above"
    return f"rank {rank} of the torchrun job failed (exit code {failure.exitcode}): {message}"
