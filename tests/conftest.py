"""Shared fixtures: compose the real Hydra config in tests, with small synthetic token data.

Tests write only under pytest's temporary directories: composed configs cache tokenized corpora in one
session-wide temporary cache (``data_cache_dir``), runs get a ``train.output_dir`` under ``tmp_path``, and a
check at the end of the session fails it if the repository gained an entry (a Hydra ``outputs/`` run
directory, a ``.cache/data`` corpus: what a run writes when no directory is given).
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from training.config import TrainConfig, register_schema, to_train_config

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = str(REPO / "conf")
# The session's tokenized-corpus cache, set by the data_cache_dir fixture. An environment variable, not a module
# global: pytest imports this file as `conftest` and the tests import it again as `tests.conftest`.
DATA_CACHE_ENV = "QWEN_MOE_TEST_DATA_CACHE"

# A debug model small enough that a training step takes milliseconds.
TINY_MODEL = [
    "model.arch.vocab_size=256", "model.arch.hidden_size=32", "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2", "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16",
]


# ------------------------------------------------------------- transformers beside this repository's kernels/

# transformers 5.25 and later depend on the PyPI package `kernels`, whose import name is also this repository's
# kernels/: in a process started at the repository root (every test) `import kernels` finds ours. transformers
# imports `kernels` at import time in one module only, its hub-kernels integration (elsewhere only to kernelize a model
# with use_kernels=True, which no test does), and keeps what it imported under its own names. So that one module is
# imported with the PyPI package as `kernels` and ours put back right after: both live in one process, transformers
# with the objects it imported, our code with ours; a comparison against transformers runs in the test's process.
# The reference is transformers' torch code: USE_HUB_KERNELS=NO keeps from_pretrained (use_kernels defaults to on
# from 5.25 where `kernels` is installed) from swapping in kernels fetched from the hub, as transformers' own tests do.
# Module level, not a pytest hook: the spawned gloo ranks and the tests' subprocesses get both too. A process started
# outside the repository needs none of this (docs/huggingface.md checks an export that way).
_HUB_KERNELS = "transformers.integrations.hub_kernels"
os.environ["USE_HUB_KERNELS"] = "NO"


def _pop_kernels() -> dict[str, ModuleType]:
    """Take ``kernels`` and its submodules, whichever package they come from, out of ``sys.modules``."""
    return {name: sys.modules.pop(name) for name in list(sys.modules)
            if name == "kernels" or name.startswith("kernels.")}


class _WithTheirKernels(importlib.abc.Loader):
    """Executes a module with the installed distribution ``kernels`` as ``kernels``, then puts ours back."""

    def __init__(self, loader: importlib.abc.Loader, theirs: importlib.machinery.ModuleSpec) -> None:
        self.loader, self.theirs = loader, theirs

    def __getattr__(self, name: str):  # get_source etc.: tracebacks through the module show its lines
        if name == "loader":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        ours = _pop_kernels()
        try:
            kernels = importlib.util.module_from_spec(self.theirs)
            sys.modules["kernels"] = kernels
            self.theirs.loader.exec_module(kernels)
            self.loader.exec_module(module)
        finally:
            _pop_kernels()
            sys.modules.update(ours)


class _TransformersKernelsFinder(importlib.abc.MetaPathFinder):
    """Finds transformers' hub-kernels integration as usual and has it executed by ``_WithTheirKernels``, where a
    ``kernels`` distribution is installed (transformers 5.25+); otherwise leaves the import alone."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if name != _HUB_KERNELS:
            return None
        try:  # the distribution transformers requires (by name, as transformers' is_kernels_available finds it)
            init = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
        except importlib.metadata.PackageNotFoundError:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not init.is_file():
            return None
        theirs = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(init.parent)])
        spec.loader = _WithTheirKernels(spec.loader, theirs)
        return spec


if not any(isinstance(finder, _TransformersKernelsFinder) for finder in sys.meta_path):  # imported twice, see above
    sys.meta_path.insert(0, _TransformersKernelsFinder())


# Composed configs by their full override list: Hydra's compose takes ~0.5 s of CPU, and a spawned rank that composes
# the same overrides for every layout it builds pays it 8x over on 2 cores. Failures are not cached.
_COMPOSED: dict[tuple[str, ...], TrainConfig] = {}


def compose_config(overrides: list[str]) -> TrainConfig:
    """The TrainConfig that ``python train.py <overrides>`` would run with, but with data.cache_dir in the session's
    temporary cache (not the repository's .cache/data) and Python's automatic GC (``train.gc_every=0``) unless
    ``overrides`` set them: the manual GC's full collection at the start of each run walks the whole test session's
    heap (about 8% of the run-heavy test files' time); tests/test_train.py checks the manual GC itself."""
    cache = os.environ.get(DATA_CACHE_ENV)
    key = (*([f"data.cache_dir={cache}"] if cache else []), "train.gc_every=0", *overrides)
    if key not in _COMPOSED:
        register_schema()
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            _COMPOSED[key] = to_train_config(compose(config_name="config", overrides=list(key)))
    return copy.deepcopy(_COMPOSED[key])  # a test may change its copy


@pytest.fixture(scope="session", autouse=True)
def data_cache_dir(tmp_path_factory) -> Iterator[Path]:
    """The session's tokenized-corpus cache: chitchat is tokenized once per session, outside the repository.
    compose_config uses it; a test running train.py passes ``data.cache_dir=<this>``."""
    path = tmp_path_factory.mktemp("data-cache")
    previous = os.environ.get(DATA_CACHE_ENV)
    os.environ[DATA_CACHE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(DATA_CACHE_ENV, None)
    else:
        os.environ[DATA_CACHE_ENV] = previous


# ----------------------------------------------------------------------------- nothing written into the repository

# Where a run writes when no directory is given (relative to the working directory: the repository here): Hydra's
# run and sweep directories, the Slurm scripts' job directories, the tokenized-corpus cache, wandb's offline runs.
_DEFAULT_OUTPUTS = ("outputs", "multirun", "runs", ".cache", "wandb")
_NOT_OURS = {".git", ".pytest_cache", "__pycache__"}  # pytest's and Python's own
_REPO_BEFORE = pytest.StashKey[set]()


def repo_entries(repo: Path = REPO) -> set[str]:
    """The repository's top-level entries, and the entries up to 3 levels under the default output directories
    (outputs/<date>/<time>/..., .cache/data/<corpus>): cheap even with a user's runs there."""
    entries = {p.name for p in repo.iterdir() if p.name not in _NOT_OURS}
    for name in _DEFAULT_OUTPUTS:
        for root, dirs, files in os.walk(repo / name):
            rel = Path(root).relative_to(repo)
            entries |= {str(rel / f) for f in files} | {str(rel / d) for d in dirs}
            if len(rel.parts) >= 3:
                dirs.clear()
    return entries


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_REPO_BEFORE] = repo_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if tests wrote into the repository (a run without train.output_dir or data.cache_dir)."""
    before = session.config.stash.get(_REPO_BEFORE, None)
    if before is None:
        return
    new = sorted(repo_entries() - before)
    if not new:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "the tests wrote into the repository", red=True)
        for entry in new[:20]:
            reporter.write_line(f"  {entry}")
        reporter.write_line(f"  ({len(new)} new entries) tests must write under tmp_path: give runs train.output_dir "
                            "(or hydra.run.dir / hydra.sweep.dir) and data.cache_dir (tests/conftest.py)")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def our_loss_like_transformers(model, input_ids_BT: torch.Tensor, num_experts: int, aux_coef: float):
    """(loss, output) of our model for what transformers computes with ``labels=input_ids`` and
    output_router_logits: mean token cross-entropy (transformers shifts the labels itself; we pass them
    shifted, with nothing to predict after the last token) + coef x Switch aux loss. The cross-entropy goes
    through the chunked LM head + loss that training uses."""
    from training.loss import IGNORE_INDEX, router_loss_shares

    labels_BT = torch.cat([input_ids_BT[:, 1:], torch.full_like(input_ids_BT[:, :1], IGNORE_INDEX)], dim=1)
    out = model(input_ids_BT, labels_BT=labels_BT)
    ce = out.loss_sum / (labels_BT != IGNORE_INDEX).sum()
    return ce + aux_coef * router_loss_shares(out.router_stats, num_experts)[0], out


def write_tokens(path: Path, num_tokens: int, vocab_size: int = 256, seed: int = 0) -> Path:
    """A .npy token corpus with learnable structure (a noisy repeating pattern)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab_size, size=97)
    ids = np.resize(base, num_tokens)
    noise = rng.random(num_tokens) < 0.05
    ids[noise] = rng.integers(0, vocab_size, size=int(noise.sum()))
    np.save(path, ids.astype(np.int64))
    return path


CHAT_WORDS = "the a cat dog sat ran on under mat tree fast slow red blue one two three yes no maybe".split()


def write_chats(path: Path, num_conversations: int = 64, seed: int = 0) -> Path:
    """A .jsonl of conversations of 1-3 exchanges, each turn 1..29 words: under data.mask_non_assistant=true the
    windows of a batch hold very different numbers of trained tokens (some none)."""
    rng = np.random.default_rng(seed)

    def text() -> str:
        return " ".join(rng.choice(CHAT_WORDS, size=rng.integers(1, 30)))

    with open(path, "w") as f:
        for _ in range(num_conversations):
            messages = [{"role": role, "content": text()} for _ in range(rng.integers(1, 4))
                        for role in ("user", "assistant")]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def trained_tokens_per_rank(cfg: TrainConfig, dp: int, cp: int = 1) -> list[list[int]]:
    """Trained (unmasked) tokens of the first batch of ``cfg``'s run, per dp rank and cp shard: what each rank
    would normalise by if it used its own count."""
    from training.data.loader import build_data_loader
    from training.data.packing import context_shard
    from training.loss import IGNORE_INDEX

    counts = []
    for dp_rank in range(dp):
        batch = next(build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                                       dp_rank=dp_rank, dp_size=dp))
        counts.append([int((context_shard(batch, r, cp)["labels"] != IGNORE_INDEX).sum()) for r in range(cp)])
    return counts


@pytest.fixture
def tiny_run_config(tmp_path):
    """Factory: a TrainConfig for the tiny model on synthetic tokens, writing into tmp_path. On the CPU (fp32) on
    any host: train.device=auto would take a GPU host's GPU, in bf16, away from the CPU references."""

    def make(*overrides: str, num_tokens: int = 4096) -> TrainConfig:
        data = write_tokens(tmp_path / "tokens.npy", num_tokens)
        return compose_config([*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32",
                               f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}",
                               "train.local_batch_size=4", "logging.tensorboard=false", "train.device=cpu",
                               *overrides])

    torch.manual_seed(0)
    return make


def stopped_run(base: Path) -> Path:
    """Train the tiny model 4 steps on base/tokens.npy into base/run with checkpoints at 2 and 4, and leave it as if
    stopped after its last checkpoint (SIGTERM at step 4): a resume loads step 4 rather than finding it finished.
    Returns ``base``; a module trains it once (a module-scoped fixture) for its resume tests."""
    import train

    write_tokens(base / "tokens.npy", 4096)
    train.run(compose_config([*TINY_MODEL, "data=tokens", f"data.path={base / 'tokens.npy'}", "data.seq_len=32",
                              f"data.cache_dir={base / 'cache'}", f"train.output_dir={base / 'run'}",
                              "train.local_batch_size=4", "logging.tensorboard=false", "train.steps=4",
                              "checkpoint.interval=2", "train.device=cpu"]))
    record = json.loads((base / "run" / "run.json").read_text())
    (base / "run" / "run.json").write_text(json.dumps({**record, "finished": False}))
    return base


def file_size_limited(write, limit: int):
    """``write(path, array)`` under a file-size limit of ``limit`` bytes (SIGXFSZ ignored): what a full disk is to
    numpy, an OSError without an errno; the limit and the handler are put back after the call."""
    import resource
    import signal

    def limited(path, array):
        handler, limits = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limits[1]))
        try:
            write(path, array)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
            signal.signal(signal.SIGXFSZ, handler)

    return limited



@pytest.fixture
def giant_lr(monkeypatch) -> None:
    """Lets optim.lr past the bound start-up holds it to (``training.config.MAX_LR``), for the tests that make steps
    non-finite with optim.lr=1e30 (their configs set optim.weight_decay=0: lr x weight_decay >= 1 is refused too)."""
    monkeypatch.setattr("training.config.MAX_LR", float("inf"))
