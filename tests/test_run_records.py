"""A run directory is new, empty or a run of this trainer, and a run's records never reach outside it (issue 63,
items 4 and 6): a folder of the user's (``/`` among them) is refused before anything is written, and neither an
edited run.json nor a checkpoint folder that is a link makes a resume read, or train.discard_newer delete, another
run's checkpoint. docs/reliability.md lists each case with its test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import train
from tests.conftest import TINY_MODEL, compose_config, write_tokens
from training import startup
from training.checkpoint import CheckpointError

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Every entry under ``root``: a folder None, a link its target, a file its bytes."""
    return {str(p.relative_to(root)): str(p.readlink()) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


# ------------------------------------------------------------------------------------- 4. a folder that is no run
def _users_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("lr: 0.1  # the user's own\n")
    (path / "notes.txt").write_text("keep me")
    return path


def _filesystem_root_like(path: Path) -> Path:
    for folder in ("bin", "etc", "home/user"):
        (path / folder).mkdir(parents=True)
    (path / "bin" / "sh").write_bytes(b"\x7fELF")
    (path / "etc" / "passwd").write_text("root:x:0:0\n")
    return path


def _another_tools_run(path: Path) -> Path:  # its own metrics.jsonl and weights, nothing of ours
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (path / "model.safetensors").write_bytes(b"theirs")
    return path


FOLDERS = {"a user's folder with its own config.yaml": _users_folder, "a folder like /": _filesystem_root_like,
           "another tool's run": _another_tools_run}


@pytest.mark.parametrize("resume", ["none", "auto"])
@pytest.mark.parametrize("make", list(FOLDERS.values()), ids=list(FOLDERS))
def test_a_folder_that_is_no_run_is_refused_before_anything_is_written(tiny_run_config, tmp_path, make, resume):
    folder = make(tmp_path / "folder")
    before = _tree(folder)
    with pytest.raises(ValueError, match=re.escape(f"train.output_dir={folder} is neither empty nor a run directory "
                                                   "of this trainer: it holds ")):
        train.run(tiny_run_config("train.steps=1", f"train.output_dir={folder}", f"train.resume={resume}"))
    assert _tree(folder) == before


def test_a_checkpoint_dir_that_is_no_checkpoint_directory_is_refused(tiny_run_config, tmp_path):
    folder = _filesystem_root_like(tmp_path / "folder")
    before = _tree(folder)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint.dir={folder} is neither empty nor a checkpoint "
                                                   "directory of this trainer: it holds bin/, etc/, home/")):
        train.run(tiny_run_config("train.steps=1", f"checkpoint.dir={folder}"))
    assert _tree(folder) == before and not (tmp_path / "run" / "run.json").exists()


def test_the_filesystem_root_is_refused_at_start_up():
    """train.output_dir=/ with the default data (no path: nothing of / is an input): refused by the read-only plan."""
    with pytest.raises(ValueError, match=r"train.output_dir=/ is neither empty nor a run directory of this trainer"):
        startup.plan_run(compose_config(["train.output_dir=/"]), startup.World(1))


def test_empty_means_what_hydra_writes_first_and_empty_folders(tiny_run_config, tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("[]\n")
    (run / "train.log").write_text("[hydra] a previous attempt's line\n")
    (run / "hf").mkdir()  # empty: nothing a run would replace
    assert [m["step"] for m in train.run(tiny_run_config("train.steps=1"))] == [1]
    assert (run / "run.json").is_file()


def test_on_the_command_line_a_users_folder_is_one_line_and_hydra_writes_nothing_there(tmp_path):
    folder = _users_folder(tmp_path / "folder")
    before = _tree(folder)
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY_MODEL, "data=tokens",
                          f"data.path={write_tokens(tmp_path / 'tokens.npy', 4096)}", "data.seq_len=32",
                          f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1", f"train.output_dir={folder}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"train.output_dir={folder} is neither empty nor a run directory" in errors[0]
    assert _tree(folder) == before  # not even Hydra's train.log


# ------------------------------------------------------------------------------------- 6. records that point outside
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """``victim``: a finished run with checkpoints 1-3; ``mine``: a run stopped at step 2 of 4 (checkpoints 1 and 2,
    its record not finished), copied fresh by each test."""
    base = tmp_path_factory.mktemp("records")
    write_tokens(base / "tokens.npy", 4096)

    def config(run: str, *overrides: str):
        return compose_config([*TINY_MODEL, "data=tokens", f"data.path={base / 'tokens.npy'}", "data.seq_len=32",
                               f"data.cache_dir={base / 'cache'}", f"train.output_dir={base / run}",
                               "train.local_batch_size=4", "logging.tensorboard=false", "train.device=cpu",
                               "checkpoint.interval=1", *overrides])

    train.run(config("victim", "train.steps=3"))
    train.run(config("mine", "train.steps=2"))
    record = json.loads((base / "mine" / "run.json").read_text())
    (base / "mine" / "run.json").write_text(json.dumps({**record, "finished": False}))
    (base / "mine" / "model.safetensors").unlink()
    (base / "mine" / "model.safetensors.record.json").unlink()
    return base


def _mine(runs: Path, tmp_path: Path, tiny_run_config):
    """A fresh copy of ``mine`` and its config: train.steps=4 from step 3 on."""
    run = tmp_path / "mine"
    shutil.copytree(runs / "mine", run, symlinks=True)

    def config(*overrides: str):
        return tiny_run_config("train.steps=4", "checkpoint.interval=1", f"train.output_dir={run}",
                               f"data.path={runs / 'tokens.npy'}", f"data.cache_dir={runs / 'cache'}",
                               "checkpoint.keep_last=10", "train.allow_changes=[train.steps]", *overrides)

    return run, config


def _name_in_record(run: Path, entry: str) -> None:
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "checkpoint_dirs": [*record["checkpoint_dirs"], entry]}))


@pytest.mark.parametrize("how", ["relative ../", "absolute", "a link inside the run"])
def test_a_record_naming_another_runs_checkpoints_is_not_read_or_pruned(runs, tmp_path, tiny_run_config, how, caplog):
    """Before: train.resume=auto took the other run's newer step_3 (this run's metrics then read 1, 2, 4), and
    train.discard_newer deleted it."""
    run, config = _mine(runs, tmp_path, tiny_run_config)
    victim = runs / "victim" / "checkpoints"
    if how == "a link inside the run":
        (run / "elsewhere").symlink_to(victim)
    entry = {"relative ../": os.path.relpath(victim, run), "absolute": str(victim),
             "a link inside the run": "elsewhere"}[how]
    _name_in_record(run, entry)
    before = _tree(runs / "victim")
    with caplog.at_level("WARNING", logger="train"):
        resumed = train.run(config("train.resume=auto"))
    assert [m["step"] for m in resumed] == [3, 4]  # from this run's own step_2
    assert f"names the checkpoint directory {run / entry}" in caplog.text and "not read" in caplog.text
    # train.discard_newer on an older checkpoint of this run deletes this run's newer steps only.
    train.run(config(f"train.resume={run / 'checkpoints' / 'step_00000001'}", "train.discard_newer=true"))
    assert _tree(runs / "victim") == before


def test_a_checkpoint_folder_that_is_a_link_is_not_resumed(runs, tmp_path, tiny_run_config, caplog):
    run, config = _mine(runs, tmp_path, tiny_run_config)
    other = runs / "victim" / "checkpoints" / "step_00000003"
    (run / "checkpoints" / "step_00000003").symlink_to(other)
    before = _tree(runs / "victim")
    with caplog.at_level("WARNING", logger="train"):
        resumed = train.run(config("train.resume=auto"))
    assert [m["step"] for m in resumed] == [3, 4]  # from this run's own step_2
    assert f"step_00000003 is a symbolic link (to {other})" in caplog.text
    # This run's step 3 took the link's place; what it named is untouched.
    assert not (run / "checkpoints" / "step_00000003").is_symlink() and _tree(runs / "victim") == before


def test_a_checkpoint_whose_files_link_to_another_runs_is_refused(runs, tmp_path, tiny_run_config):
    run, config = _mine(runs, tmp_path, tiny_run_config)
    other = runs / "victim" / "checkpoints" / "step_00000003"
    linked = run / "checkpoints" / "step_00000003"
    linked.mkdir()
    for file in other.iterdir():
        (linked / file.name).symlink_to(file)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {linked} is damaged: ") + r".* is a symbolic "
                       r"link to " + re.escape(str(other))):
        train.run(config("train.resume=auto"))
