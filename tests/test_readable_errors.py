"""Bad input and faults that ended in a traceback or in silence (issue 53's second list): each is now one readable
line naming the file or key and the fix, before anything is written, or is made to work. docs/reliability.md lists
each case with its test."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from tests.conftest import compose_config, file_size_limited

REPO = Path(__file__).resolve().parents[1]


def _hf_dir(tiny_run_config, tmp_path: Path) -> Path:
    """A small Hugging Face export of the tiny model (its config.json and weights)."""
    cfg = tiny_run_config("train.steps=0", "checkpoint.export_hf_at_end=true", f"train.output_dir={tmp_path / 'src'}")
    train.run(cfg)
    return Path(cfg.train.output_dir) / "hf"


def _from_hf(tmp_path: Path, hf: Path, data: str, *overrides: str):
    """model=hf: the architecture is init_from's config.json."""
    return compose_config(["model=hf", f"model.init_from={hf}", "data=tokens", f"data.path={data}", "data.seq_len=32",
                           f"data.cache_dir={tmp_path / 'cache'}", "train.device=cpu", "logging.tensorboard=false",
                           f"train.output_dir={tmp_path / 'run'}", "train.local_batch_size=2", *overrides])


def test_a_config_json_whose_shapes_its_weights_lack_is_refused_before_allocating(tiny_run_config, tmp_path):
    """config.json's vocab_size=2e8 with weights of 256 rows (before: 51 GB allocated for the model, then the shape
    check): compared with the safetensors headers while the model is still on the meta device."""
    hf = _hf_dir(tiny_run_config, tmp_path)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "vocab_size": 200_000_000}))
    cfg = _from_hf(tmp_path, hf, tiny_run_config().data.path, "train.steps=1")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))  # far below the 51 GB, far above what the check needs
    try:
        with pytest.raises(ValueError, match=rf"(?s)model.init_from={hf}: its weights do not match the model its "
                                             r"config.json describes.*model.embed_tokens.weight \(checkpoint \(256, 32\), "
                                             r"model \(200000000, 32\)\)"):
            train.run(cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert {p.name for p in (tmp_path / "run").iterdir()} <= {"train.log", "run.lock"}  # a retry starts


@pytest.mark.parametrize("message, keys", [
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
     "'tool_calls'"),
    ({"role": "user", "content": "hi", "name": "ann"}, "'name'"),
], ids=["tool_calls", "name"])
def test_a_message_with_keys_the_rendering_drops_is_refused_naming_file_line_and_keys(tmp_path, message, keys):
    """The ChatML rendering reads role and content only (before: tool calls and names dropped without a word)."""
    from training.data.config import DataConfig
    from training.data.loader import build_data_loader

    path = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [good["messages"][0], message]}) + "\n")
    cfg = DataConfig(name="jsonl", path=str(path), seq_len=8, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=rf"{path} line 2: messages\[1\] has {keys} beside role and content, which the "
                                         r"ChatML rendering here does not render .*into content, or remove the keys"):
        build_data_loader(cfg, seed=0, local_batch_size=1, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("written, read", [("uint32", "uint16"), ("uint16", "uint8"), ("int64", "int32")])
def test_a_bin_read_at_half_its_width_is_refused_naming_the_dtype(tmp_path, written, read):
    """uint32 ids read with data.bin_dtype=uint16 (before: trained on id, 0, id, 0); read at their own width they
    load as they are."""
    from training.data.token_shards import load_token_stream

    ids = np.random.default_rng(0).integers(1, 200, size=1000)
    path = tmp_path / "ids.bin"
    ids.astype(np.dtype(written).newbyteorder("<")).tofile(path)
    with pytest.raises(ValueError, match=rf"token shard {path} read as data.bin_dtype={read} has 0 at every second of "
                                         rf"its first 2000 ids: it holds {written} ids .*set data.bin_dtype={written}"):
        load_token_stream(str(path), read, str(tmp_path / "cache"))
    data = load_token_stream(str(path), written, str(tmp_path / "cache"))
    assert data.vocab_size == ids.max() + 1


def test_an_eos_id_outside_the_vocabulary_is_refused(tiny_run_config, tmp_path):
    """data.eos_id=100000 with 256 ids (before: accepted, and no document ever ended); 255 is still taken."""
    with pytest.raises(ValueError, match=r"data.eos_id=100000 is outside the model's vocabulary \(model.arch.vocab_size="
                                         r"256\), so no token would end a document"):
        train.run(tiny_run_config("train.steps=1", "data.eos_id=100000"))
    assert train.run(tiny_run_config("train.steps=1", "data.eos_id=255", f"train.output_dir={tmp_path / 'b'}"))


def test_a_nan_grad_clip_is_refused_as_a_nan_lr_is(tiny_run_config):
    """optim.grad_clip=nan (before: accepted, and no step clipped, while optim.lr=nan was refused)."""
    from training.config import validate

    with pytest.raises(ValueError, match=r"optim.grad_clip=nan must be a number: the largest gradient norm \(> 0\), "
                                         r"or <= 0 for no clipping"):
        validate(tiny_run_config("optim.grad_clip=nan"))
    with pytest.raises(ValueError, match=r"optim.lr=nan must be positive"):
        validate(tiny_run_config("optim.lr=nan"))
    for clip in ("0", "-1", "0.5"):
        validate(tiny_run_config(f"optim.grad_clip={clip}"))
    with pytest.raises(ValueError, match=r"optim.grad_clip=inf must be a finite number \(optim.grad_clip <= 0: no "
                                         r"clipping\)"):  # no float of the config may be non-finite (issue 63)
        validate(tiny_run_config("optim.grad_clip=inf"))


def test_the_start_says_how_many_times_the_run_reads_its_data(tiny_run_config, tmp_path, caplog):
    """train.steps far past the corpus (before: not a word): 330 tokens make 10 windows of 33; 8 steps of 4 windows
    read them 3.2 times; a mixture says it per source, by weight."""
    with caplog.at_level("INFO", logger="train"):
        train.run(tiny_run_config("train.steps=8", num_tokens=330))
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.getMessage().startswith("data:")]
    assert warned == ["data: 8 steps of 4 windows read the corpus of 10 windows 3.20 times over: each window about 3 "
                      "times (epochs)"]
    from training.data.config import DataConfig, SourceConfig
    from training.data.loader import build_data_loader

    path = str(tiny_run_config(num_tokens=330).data.path)
    mixture = DataConfig(name="tokens", seq_len=32, cache_dir=str(tmp_path / "cache"),
                         sources=[SourceConfig(path, 3, "a"), SourceConfig(path, 1, "b")])
    loader = build_data_loader(mixture, seed=0, local_batch_size=4, dp_rank=0, dp_size=1)
    assert loader.passes(2) == ["2 steps of 4 windows read source 'a' (75% of the windows) of 10 windows 0.60 times "
                                "over", "2 steps of 4 windows read source 'b' (25% of the windows) of 10 windows 0.20 "
                                "times over"]


def test_sighup_stops_as_sigterm_does_with_a_checkpoint(tmp_path):
    """The terminal or ssh session closed (before: exit 129, nothing logged, nothing saved since the last checkpoint):
    a checkpoint at the current step, logged, exit 0, and train.resume=auto continues from it."""
    from tests.test_run_safety import _losses, _signalled_after_step_2
    from training.checkpoint import complete_checkpoints

    proc, stderr, run_dir = _signalled_after_step_2(tmp_path, signal.SIGHUP)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    stopped = max(_losses(run_dir))
    assert complete_checkpoints(run_dir / "checkpoints")[-1].name == f"step_{stopped:08d}"
    assert f"stopping at step {stopped} on SIGHUP after saving a checkpoint" in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("name", ["it's a run", "a\\'b", "x=1,y=[2]", "ends\\"])
def test_a_run_directory_with_a_quote_reaches_the_torchrun_children_as_it_is(tmp_path, monkeypatch, name):
    """launch.nproc_per_node=2 into a folder whose name holds a quote (before: Hydra's lexer error from each rank):
    the override the children parse names the same directory."""
    import torch.distributed.run as torchrun
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from training.launch import LaunchConfig, relaunch_with_torchrun

    launched = []
    monkeypatch.setattr(torchrun, "run", lambda args: launched.append(args))
    monkeypatch.setattr(torchrun, "parse_args", lambda args: args)
    run_dir = str(tmp_path / name)
    relaunch_with_torchrun(LaunchConfig(nproc_per_node=2), ["train.steps=1"], run_dir, ("conf", "config"), tmp_path)
    overrides = [arg for arg in launched[0] if "=" in arg and not arg.startswith("-")]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    assert parsed == {"train.steps": 1, "train.output_dir": run_dir}


def test_sigterm_to_the_launcher_stops_the_job_with_a_checkpoint_and_one_line(tmp_path):
    """launch.nproc_per_node=2 and SIGTERM to the launching process (before: the ranks saved a checkpoint, then a
    30-line traceback and exit 1): torchrun passes it on, the ranks stop with a checkpoint, the launcher says so."""
    from tests.test_run_safety import _args, _logged, _losses, _wait_for
    from training.checkpoint import complete_checkpoints

    proc = subprocess.Popen(_args(tmp_path, "train.steps=100000", "launch.nproc_per_node=2", "parallel=ep2",
                                  "train.local_batch_size=1"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "run"
    _wait_for(lambda: _logged(run_dir, 2), proc, "step 2")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    saved = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert saved.name == f"step_{max(_losses(run_dir)):08d}"
    assert stderr.splitlines()[-1] == (f"stopped on SIGTERM: torchrun passed it on to the ranks; the newest checkpoint "
                                       f"is {saved}: train.resume=auto continues from it")


def test_a_sweep_with_a_failing_job_runs_the_others_and_ends_naming_it(tmp_path):
    """-m optim.lr=1e-3,nan,2e-3 (before: job #1's error line without its job, job #2 never ran, and nothing said
    so): each failed job's line names it, the other jobs run, and the sweep ends with one line naming the failed
    ones, exit code 1."""
    from tests.test_run_safety import _args, _losses

    command = _args(tmp_path, "optim.lr=1e-3,nan,2e-3", "train.steps=1")  # train.output_dir=<tmp>/run
    out = subprocess.run([*command[:2], "-m", *command[2:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("error:")] == [
        "error: sweep job #1 (optim.lr=nan): ValueError: optim.lr=nan must be positive",
        "error: 1 of the sweep's 3 jobs failed, each said why above: #1 (optim.lr=nan); the others finished"]
    assert [sorted(_losses(tmp_path / "run" / str(job))) for job in (0, 2)] == [[1], [1]]
    assert not (tmp_path / "run" / "1" / "metrics.jsonl").exists()


def _export(run: Path, out: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import export_hf
    finally:
        sys.path.pop(0)
    export_hf.main([str(run), str(out)])


def test_an_export_says_which_step_it_exports_and_that_the_run_went_on_since(tiny_run_config, tmp_path, capsys):
    """export_hf.py RUN after the run was continued past its final save without writing new final weights (before:
    the older weights exported without a word)."""
    cfg = tiny_run_config("train.steps=2")
    train.run(cfg)
    run = Path(cfg.train.output_dir)
    _export(run, tmp_path / "hf2")
    out = capsys.readouterr()
    assert f"exported {run / 'model.safetensors'} (qwen3_moe, step 2)" in out.out and "warning" not in out.err
    train.run(tiny_run_config("train.steps=4", "train.resume=auto", "train.allow_changes=[train.steps]",
                              "train.save_final=false", "checkpoint.interval=2"))  # on to step 4: no new final weights
    _export(run, tmp_path / "hf4")
    out = capsys.readouterr()
    assert f"exported {run / 'model.safetensors'} (qwen3_moe, step 2)" in out.out
    assert (f"warning: {run / 'model.safetensors'} holds step 2, and its run has trained since, to step 4: to export "
            f"that, export its newest checkpoint ({run / 'checkpoints' / 'step_00000004'})") in out.err


def test_final_weights_with_a_zeroed_region_are_refused_by_their_record(tiny_run_config, tmp_path):
    """model.safetensors with zeroed bytes, its size unchanged (before: exported without a check)."""
    from training.checkpoint import CheckpointError

    cfg = tiny_run_config("train.steps=1")
    train.run(cfg)
    weights = Path(cfg.train.output_dir) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:-2048] = bytes(2048)
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{weights} is damaged: model.safetensors bytes \[0, {len(data)}\) "
                                              r"differ from what was written. The run's checkpoints hold the weights"):
        _export(weights.parent, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_temporaries_of_a_killed_save_are_removed_at_the_next_start_and_nothing_else(tiny_run_config, tmp_path):
    """A kill during the final save or an export leaves .model.safetensors.tmp-<pid> and .hf.tmp-<pid>-* (before:
    forever). The next start removes those of this project's naming whose process is gone; a live process's, and
    any other file, stay."""
    cfg = tiny_run_config("train.steps=1")
    train.run(cfg)
    run = Path(cfg.train.output_dir)
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        stale = [run / f".model.safetensors.tmp-{dead.pid}", run / f".hf.tmp-{dead.pid}-a1b_2",
                 run / f".hf.old-{dead.pid}-x9", run / f".run.json.tmp-{dead.pid}"]
        kept = [run / f".model.safetensors.tmp-{alive.pid}", run / f".hf.tmp-{alive.pid}-q", run / ".x.tmp-mine",
                run / f"notes.tmp-{dead.pid}", run / f".x.tmp-{dead.pid}.bak"]
        for path in stale + kept:
            (path.mkdir() if "hf." in path.name else path.write_text("x"))
        (run / f".hf.tmp-{dead.pid}-a1b_2" / "model.safetensors").write_text("half")
        train.run(tiny_run_config("train.steps=2", "train.resume=auto", "train.allow_changes=[train.steps]"))
        assert [p for p in stale if p.exists()] == [] and all(p.exists() for p in kept)
        # An export elsewhere: the stale temporaries of its own directory, in its parent.
        out = tmp_path / "exports" / "hf"
        out.parent.mkdir()
        (out.parent / f".hf.tmp-{dead.pid}-zz").mkdir()
        (out.parent / f".other.tmp-{dead.pid}-zz").mkdir()
        _export(run, out)
        assert sorted(p.name for p in out.parent.iterdir()) == [f".other.tmp-{dead.pid}-zz", "hf"]
    finally:
        alive.kill()
        alive.wait()


def test_discard_newer_removes_a_symlinked_step_folder_as_a_link_and_keeps_its_target(tiny_run_config, tmp_path):
    """train.discard_newer over a step folder that is a symbolic link (before: rmtree refused the link after the
    step before it was already deleted): the link goes, the folder it points to stays, the steps train again."""
    from training.checkpoint import complete_checkpoints

    cfg = tiny_run_config("train.steps=4", "checkpoint.interval=1")
    full = train.run(cfg)
    root = Path(cfg.train.output_dir) / "checkpoints"
    elsewhere = tmp_path / "kept" / "step_00000004"
    elsewhere.parent.mkdir()
    (root / "step_00000004").rename(elsewhere)
    (root / "step_00000004").symlink_to(elsewhere, target_is_directory=True)
    again = train.run(tiny_run_config("train.steps=4", "checkpoint.interval=1", f"train.resume={root / 'step_00000002'}",
                                      "train.discard_newer=true"))
    assert [m["loss"] for m in again] == pytest.approx([m["loss"] for m in full[2:]], rel=1e-6)
    assert elsewhere.is_dir() and any(elsewhere.iterdir())  # the link's target is not the run's to remove
    assert [p.name for p in complete_checkpoints(root)][-1] == "step_00000004" and not (root / "step_00000004").is_symlink()


def test_a_run_finished_at_steps_0_trains_on_when_given_more_steps(tiny_run_config, tmp_path):
    """train.steps=0 (it measures the first loss, trains nothing) then train.resume=auto with train.steps=3 (before:
    'finished: nothing to do; to train on, raise train.steps', which was done): it trains steps 1-3 exactly as a
    fresh 3-step run. A run that finished at step 2 without any checkpoint cannot go on, and says why."""
    assert [m["step"] for m in train.run(tiny_run_config("train.steps=0"))] == [0]
    more = train.run(tiny_run_config("train.steps=3", "train.resume=auto", "train.allow_changes=[train.steps]"))
    fresh = train.run(tiny_run_config("train.steps=3", f"train.output_dir={tmp_path / 'fresh'}"))
    assert [m["loss"] for m in more] == pytest.approx([m["loss"] for m in fresh], rel=1e-6) and len(more) == 3
    no_checkpoint = (f"train.output_dir={tmp_path / 'bare'}", "checkpoint.at_end=false")
    train.run(tiny_run_config("train.steps=2", *no_checkpoint))
    with pytest.raises(ValueError, match=rf"run {tmp_path / 'bare'} finished at step 2 without a checkpoint .*no state "
                                         r"to train on from: start afresh in another train.output_dir"):
        train.run(tiny_run_config("train.steps=4", "train.resume=auto", "train.allow_changes=[train.steps]",
                                  *no_checkpoint))


def test_a_full_disk_while_tokenizing_into_the_cache_names_the_folder_and_the_key(tmp_path, monkeypatch):
    """A file-size limit (what a full disk is to numpy: an OSError without an errno or a file) around the writes of
    the tokenized shards under data.cache_dir (before: '... requested and ... written', no file, no key)."""
    import resource

    from training.data import tokenize_shards
    from training.data.config import DataConfig
    from training.data.loader import build_data_loader

    monkeypatch.setattr(tokenize_shards, "atomic_write_npy", file_size_limited(tokenize_shards.atomic_write_npy, 64))
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"text": "hello there, a document of some words"}) + "\n")
    cfg = DataConfig(name="jsonl", path=str(path), seq_len=4, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(OSError, match=rf"could not write the tokenized-corpus cache {tmp_path / 'cache'}/jsonl-qwen3-"
                                      r"\w+\.shards \([\d.]+ GiB free there\): .*\. Free space there, or point "
                                      r"data\.cache_dir at a folder with room"):
        build_data_loader(cfg, seed=0, local_batch_size=1, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("errno_name", ["EACCES", "EROFS"])
def test_a_run_folder_made_read_only_mid_run_is_one_line_naming_the_file(tiny_run_config, monkeypatch, errno_name):
    """The run folder's permissions taken away (or its file system remounted read-only) under a running job (before:
    the bare PermissionError of whichever write came first). Simulated: the tests run as root, which permissions
    do not stop. The checkpoint at step 2 and the final weights."""
    import errno

    from training import checkpoint as ckpt

    code = getattr(errno, errno_name)
    saves, save = [], ckpt.dcp.save

    def denied_at_step_2(state, checkpoint_id):
        saves.append(checkpoint_id)
        if len(saves) == 2:
            raise PermissionError(code, os.strerror(code), f"{checkpoint_id}/__0_0.distcp")
        return save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(ckpt.dcp, "save", denied_at_step_2)
    cfg = tiny_run_config("train.steps=3", "checkpoint.interval=1")
    root = Path(cfg.train.output_dir) / "checkpoints"
    why = {"EACCES": "permission denied", "EROFS": "read-only file system"}[errno_name]
    with pytest.raises(ckpt.CheckpointError, match=rf"could not write checkpoint {root / 'step_00000002'}: {why} on "
                                                   rf"{root / '.tmp-step_00000002'}/__0_0.distcp \(its folder made read-"
                                                   rf"only under the run\?\): make it writable again; the previous "
                                                   rf"checkpoint {root / 'step_00000001'} is intact"):
        train.run(cfg)
    monkeypatch.undo()

    def denied(path, *args, **kwargs):
        raise PermissionError(code, os.strerror(code), str(path))

    monkeypatch.setattr(ckpt, "write_safetensors", denied)
    run = Path(cfg.train.output_dir)
    with pytest.raises(ckpt.CheckpointError, match=rf"could not write {run / 'model.safetensors'}: {why} on "
                                                   rf"{run}/.model.safetensors.tmp-\d+ \(its folder made read-only under "
                                                   rf"the run\?\): make it writable again; the trained state is in "
                                                   rf"checkpoint {root / 'step_00000003'}"):
        train.run(tiny_run_config("train.steps=3", "checkpoint.interval=1", "train.resume=auto"))
