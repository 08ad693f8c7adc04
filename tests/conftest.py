"""Shared fixtures: compose the real Hydra config in tests, with small synthetic token data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from training.config import TrainConfig, register_schema, to_train_config

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

# A debug model small enough that a training step takes milliseconds.
TINY_MODEL = [
    "model.arch.vocab_size=256", "model.arch.hidden_size=32", "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2", "model.arch.head_dim=8", "model.arch.moe_intermediate_size=16",
]


def compose_config(overrides: list[str]) -> TrainConfig:
    """The TrainConfig that ``python train.py <overrides>`` would run with."""
    register_schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return to_train_config(compose(config_name="config", overrides=overrides))


def our_loss_like_transformers(model, input_ids_BT: torch.Tensor, num_experts: int, aux_coef: float):
    """(loss, output) of our model for what transformers computes with ``labels=input_ids`` and
    output_router_logits: mean token cross-entropy (transformers shifts the labels itself; we pass them
    shifted, with nothing to predict after the last token) + coef x Switch aux loss. The cross-entropy goes
    through the chunked LM head + loss that training uses."""
    from training.loss import IGNORE_INDEX, aux_loss_share

    labels_BT = torch.cat([input_ids_BT[:, 1:], torch.full_like(input_ids_BT[:, :1], IGNORE_INDEX)], dim=1)
    out = model(input_ids_BT, labels_BT=labels_BT)
    ce = out.loss_sum / (labels_BT != IGNORE_INDEX).sum()
    return ce + aux_coef * aux_loss_share(out.router_stats, num_experts), out


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
    from training.data import build_data_loader, context_shard
    from training.loss import IGNORE_INDEX

    counts = []
    for dp_rank in range(dp):
        batch = next(build_data_loader(cfg.data, seed=cfg.train.seed, local_batch_size=cfg.train.local_batch_size,
                                       dp_rank=dp_rank, dp_size=dp))
        counts.append([int((context_shard(batch, r, cp)["labels"] != IGNORE_INDEX).sum()) for r in range(cp)])
    return counts


@pytest.fixture
def tiny_run_config(tmp_path):
    """Factory: a TrainConfig for the tiny model on synthetic tokens, writing into tmp_path."""

    def make(*overrides: str, num_tokens: int = 4096) -> TrainConfig:
        data = write_tokens(tmp_path / "tokens.npy", num_tokens)
        return compose_config([*TINY_MODEL, "data=tokens", f"data.path={data}", "data.seq_len=32",
                               f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}",
                               "train.local_batch_size=4", "logging.tensorboard=false", *overrides])

    torch.manual_seed(0)
    return make
