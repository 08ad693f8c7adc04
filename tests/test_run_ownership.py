"""What a run writes is its own (issue 53): an output directory that is, holds or lies inside an input is refused
(symlinks, ``..`` and trailing slashes resolved), another run's checkpoint is not resumed into a directory that
holds a run, and a checkpoint.dir outside the run directory is held and owned as the run directory is.
docs/reliability.md lists each case with its test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import train
from models import build_args, get_spec
from models.hf_io import export_hf
from tests.conftest import TINY_MODEL, write_tokens
from training import run_dir
from training.checkpoint import CheckpointError

REPO = Path(__file__).resolve().parents[1]

def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root`` (a directory: None) and each file's bytes."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.fixture
def hf_dir(tiny_run_config, tmp_path) -> Path:
    """A model.init_from directory of the tiny model."""
    cfg = tiny_run_config()
    model = get_spec("qwen3_moe").model_cls(build_args("qwen3_moe", dict(cfg.model.arch)))
    model.init_weights()
    export_hf(model, "qwen3_moe", tmp_path / "hf")
    return tmp_path / "hf"


# ------------------------------------------------------------------------------------- an output over an input
@pytest.mark.parametrize("output, checkpoints, match", [
    ("{hf}", None, "train.output_dir={hf} is model.init_from={hf}"),
    ("{tmp}/link/", None, "train.output_dir={tmp}/link is model.init_from={hf}"),  # a symlink, a trailing slash
    ("{hf}/../hf", None, "train.output_dir={hf}/../hf is model.init_from={hf}"),
    ("{hf}/run", None, "train.output_dir={hf}/run is inside model.init_from={hf}"),
    ("{tmp}", None, "train.output_dir={tmp} contains model.init_from={hf}"),
    ("{tmp}/run", "{hf}/checkpoints", "checkpoint.dir={hf}/checkpoints is inside model.init_from={hf}"),
    ("{tmp}/data/shard_0.npy/..", None, "train.output_dir={tmp}/data/shard_0.npy/.. is data.path={tmp}/data"),
    ("{tmp}/data/run", None, "train.output_dir={tmp}/data/run is inside data.path={tmp}/data"),  # a glob's directory
])
def test_an_output_over_an_input_is_refused_before_anything_is_written(tiny_run_config, tmp_path, hf_dir, output,
                                                                       checkpoints, match):
    (tmp_path / "link").symlink_to(hf_dir)
    (tmp_path / "data").mkdir()
    write_tokens(tmp_path / "data" / "shard_0.npy", 4096)
    fill = {"hf": hf_dir, "tmp": tmp_path}
    cfg = tiny_run_config("train.steps=1", f"model.init_from={hf_dir}", f"data.path={tmp_path}/data/*.npy",
                          f"train.output_dir={output.format(**fill)}",
                          *([f"checkpoint.dir={checkpoints.format(**fill)}"] if checkpoints else []))
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=re.escape(match.format(**fill))):
        train.run(cfg)
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------------------------- another run's checkpoint
def test_another_runs_checkpoint_is_not_resumed_over_a_run(tiny_run_config, tmp_path):
    """Before: run U's step_1 resumed into finished run X replaced X's newest checkpoint and weights and pruned the
    rest, exit 0. Now refused naming both, with train.discard_newer too (it discards only a run's own steps)."""
    other, run = tmp_path / "runs" / "u", tmp_path / "runs" / "x"
    train.run(tiny_run_config("train.steps=2", "checkpoint.interval=1", f"train.output_dir={other}"))
    train.run(tiny_run_config("train.steps=2", "checkpoint.interval=1", f"train.output_dir={run}"))
    step_1 = other / "checkpoints" / "step_00000001"
    before = _tree(tmp_path / "runs")
    for discard in ("false", "true"):
        with pytest.raises(CheckpointError, match=re.escape(f"train.resume={step_1} is a checkpoint of the run in "
                                                            f"{other}, but {run} already holds another run (")):
            train.run(tiny_run_config("train.steps=2", f"train.resume={step_1}", f"train.output_dir={run}",
                                      f"train.discard_newer={discard}"))
    # Where the two overlap: a run directory inside the checkpoint, or around it.
    for output, where in ((step_1 / "run", "is inside it"), (tmp_path / "runs", "contains it")):
        with pytest.raises(CheckpointError, match=re.escape(f"train.output_dir={output} {where}")):
            train.run(tiny_run_config("train.steps=2", f"train.resume={step_1}", f"train.output_dir={output}"))
    assert _tree(tmp_path / "runs") == before
    # A new directory starts from it.
    resumed = train.run(tiny_run_config("train.steps=2", f"train.resume={step_1}", f"train.output_dir={tmp_path / 'y'}"))
    assert [m["step"] for m in resumed] == [2]


# ------------------------------------------------------------------------------------- a shared checkpoint.dir
def test_a_checkpoint_dir_is_held_and_owned_like_the_run_directory(tiny_run_config, tmp_path):
    """Before: two runs into one checkpoint.dir, one crashed mid-save and the other's checkpoints were left; a later
    run was told to change train.output_dir."""
    shared, first = tmp_path / "shared", tmp_path / "first"
    train.run(tiny_run_config("train.steps=2", f"train.output_dir={first}", f"checkpoint.dir={shared}"))
    before = _tree(shared)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint.dir={shared} holds another run's checkpoints "
                                                        f"(the run in {first}); ") + ".*choose another checkpoint.dir"):
        train.run(tiny_run_config("train.steps=2", f"train.output_dir={tmp_path / 'second'}",
                                  f"checkpoint.dir={shared}", "train.resume=auto"))
    assert _tree(shared) == before and not (tmp_path / "second" / "run.json").exists()
    # Its own run continues there.
    more = train.run(tiny_run_config("train.steps=3", f"train.output_dir={first}", f"checkpoint.dir={shared}",
                                     "train.resume=auto", "train.allow_changes=[train.steps]"))
    assert [m["step"] for m in more] == [3]
    # While a run holds a checkpoint.dir (none saved yet), another is refused naming it.
    fresh = tmp_path / "fresh"
    with run_dir.lock_checkpoint_dir(fresh, tmp_path / "holder"):
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint.dir={fresh} is in use by another run (pid ")
                           + f".*; run {re.escape(str(tmp_path / 'holder'))}\\); .*another checkpoint.dir"):
            train.run(tiny_run_config("train.steps=1", f"train.output_dir={tmp_path / 'third'}",
                                      f"checkpoint.dir={fresh}"))
    assert not (tmp_path / "third" / "run.json").exists()


def test_on_the_command_line_the_refusal_comes_before_hydra_makes_the_directory(tiny_run_config, tmp_path, hf_dir):
    """Checked where Hydra resolves its run directory: neither <init_from>/run nor Hydra's train.log in it is made."""
    before = _tree(tmp_path)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY_MODEL, "data=tokens",
                          f"data.path={tmp_path / 'tokens.npy'}", f"data.cache_dir={tmp_path / 'cache'}",
                          f"model.init_from={hf_dir}", f"train.output_dir={hf_dir / 'run'}"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert f"error: ValueError: train.output_dir={hf_dir / 'run'} is inside model.init_from={hf_dir}" in out.stderr
    assert _tree(tmp_path) == before
