"""The loader: a dp rank's endless packed batches, in an order that does not depend on the layout.

Every document is tokenized, followed by <|endoftext|>, and concatenated into one stream of ids with a
parallel loss mask. The stream is cut into non-overlapping windows of seq_len + 1 tokens (the tail is
dropped). Window order is a per-epoch permutation fixed by the seed. Global micro-batch k is windows
[k*g, (k+1)*g) of that order, with g = local_batch_size * dp_size, and dp rank r takes the contiguous
rows [r*local_batch_size, (r+1)*local_batch_size), so batches do not depend on the parallel layout.

Pre-tokenized data (``data=tokens``) may be many shards (``training.data.token_shards``: one memory-mapped stream) and a
mixture of sources (``data.sources``): then slot j of global batch n comes from the source drawn for it by
``np.random.default_rng([seed, n])`` with the sources' weights, and each source hands out its windows, slot by slot,
from its own seeded per-epoch order with its own epoch and position. The draw depends on (seed, n) only, so a
mixture's batches, too, do not depend on the parallel layout.

Validation (``data.val_fraction``): the last fraction of each source's tokens, from the first document start at or
after the cut, is held out; its windows, in order (source after source), make the fixed validation batches
(``ValidationSet``), cut like the training batches into dp ranks' rows, so their loss does not depend on the layout.

Packed documents (``data.document_mask``): position ids restart at each document start (after <|endoftext|>), which
tells the model to keep attention and DeltaNet within documents (``models.layers.document_ids``). Under context
parallelism the cp ranks of a dp slice read the same rows, each keeping its contiguous 1/cp (``context_shard``).

Chats with images (data=jsonl, for a model with a vision tower: ``vision``) are cut into windows that never split an
image, and every batch of such a corpus is multimodal (``training.data.packing``): its images are read and processed
as its batch is made, in this process. A corpus without an image yields text batches, whatever the model.

Letters as in DEVELOPERS.md: B the local batch, T seq_len, T1 = seq_len + 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from training.data.cache import tokenized_corpus
from training.data.config import (DataConfig, SourceConfig, source_names, source_path, token_paths,
                                  validate_data_config)
from training.data.packing import Images, Source, hold_out, packed_batch
from training.data.token_shards import WindowOrder, load_token_stream
from training.data.tokenizer import TOKENIZERS, QwenTokenizer, special_tokens
from training.data.validation import ValidationSet
from training.data.vision import VisionData

logger = logging.getLogger(__name__)
# train.allow_changes entries that make a change of the data's contents on resume deliberate
_DATA_CHANGE_KEYS = ("data", "data.path", "data.sources")
# Above this share of special tokens among the trained labels a corpus teaches (almost) only document and turn ends:
# text has one <|endoftext|> per document of tens to thousands of tokens, and even one-word chat answers
# ("yes<|im_end|>") are 50% special; 3,000 empty texts, or chats with empty assistant turns, are 100%.
SPECIAL_ONLY_SHARE = 0.9


class PackedLoader:
    """Endless iterator of packed batches for one dp rank; see the module docstring for the order."""

    def __init__(
        self,
        sources: list[Source],
        *,
        seq_len: int,
        vocab_size: int,
        seed: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        eos_id: int | None = None,
        vision: VisionData | None = None,
    ) -> None:
        self._sources = sources
        self._eos_id = eos_id  # None: position ids 0..T-1 in every window, else restarting after each eos
        self.vision = vision  # a multimodal corpus: every batch multimodal (training.data.packing)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._seed = seed
        self._local_batch = local_batch_size
        self._rank_offset = dp_rank * local_batch_size
        self._global_batch = local_batch_size * dp_size
        mixture = len(sources) > 1
        self._orders = [WindowOrder(src.num_windows(seq_len), (seed, i) if mixture else (seed,))
                        for i, src in enumerate(sources)]
        for src, order in zip(sources, self._orders):
            if order.num_windows < self._global_batch:
                what = f"source {src.name!r} of data.sources" if mixture else "corpus"
                raise ValueError(
                    f"{what} too small: {len(src.ids)} tokens make {order.num_windows} windows of "
                    f"data.seq_len={seq_len} (+1), fewer than one global batch of {self._global_batch}; lower "
                    "data.seq_len or the batch size"
                )
        self.num_windows = sum(order.num_windows for order in self._orders)
        self.validation: ValidationSet | None = None  # the held-out data (build_data_loader, data.val_fraction)
        weights = np.array([src.weight for src in sources], dtype=np.float64)
        self._p = weights / weights.sum()
        self._drawn = 0  # windows of all global batches so far (a mixture's position)
        self._windows = [0] * len(sources)  # per source: windows of all global batches so far

    @property
    def epoch(self) -> int:
        """The single source's epoch; a mixture has none of its own (0): its sources' are in state_dict."""
        return self._orders[0].epoch if len(self._orders) == 1 else 0

    @property
    def position(self) -> int:
        """The single source's index in its epoch's order; a mixture's windows drawn so far (n x global batch)."""
        return self._orders[0].position if len(self._orders) == 1 else self._drawn

    def __iter__(self) -> PackedLoader:
        return self

    def _global_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Source and window of each slot of the next global batch; advances every source's order."""
        g = self._global_batch
        if len(self._orders) == 1:
            source_G, window_G = np.zeros(g, dtype=np.int64), self._orders[0].take(g)
        else:
            source_G = np.random.default_rng([self._seed, self._drawn // g]).choice(len(self._orders), size=g,
                                                                                   p=self._p)
            window_G = np.empty(g, dtype=np.int64)
            for s, order in enumerate(self._orders):
                at = source_G == s
                window_G[at] = order.take(int(at.sum()))
        for s in range(len(self._orders)):
            self._windows[s] += int((source_G == s).sum())
        self._drawn += g
        return source_G, window_G

    def __next__(self) -> dict[str, torch.Tensor]:
        source_G, window_G = self._global_slots()
        rows = slice(self._rank_offset, self._rank_offset + self._local_batch)
        return packed_batch(self._sources, source_G[rows], window_G[rows], self.seq_len, self._eos_id, self.vision)

    def passes(self, global_batches: int) -> list[str]:
        """How many times over ``global_batches`` global batches read each source (a mixture's: expected, by its
        weight), as the start-up log says it: a run far past its corpus repeats every window many times."""
        windows = global_batches * self._global_batch
        lines = []
        for src, p, order in zip(self._sources, self._p, self._orders):
            what = f"source {src.name!r} ({p:.0%} of the windows)" if len(self._sources) > 1 else "the corpus"
            epochs = windows * p / order.num_windows
            lines.append(f"{global_batches} steps of {self._global_batch} windows read {what} of {order.num_windows:,} "
                         f"windows {epochs:.2f} times over" + (f": each window about {round(epochs)} times (epochs)"
                                                               if epochs >= 1.5 else ""))
        return lines

    def mixture_metrics(self) -> dict[str, float]:
        """Realised share of each source's windows over all global batches so far ({} without a mixture)."""
        if len(self._sources) == 1 or not self._drawn:
            return {}
        return {f"data/share/{src.name}": n / self._drawn for src, n in zip(self._sources, self._windows)}

    def check_data_unchanged(self) -> None:
        """ValueError naming a token shard changed on disk since the run opened it (``ShardFiles``): called before
        every checkpoint, so none records a data identity that is not what was read. (Other data is read into
        memory at the start.)"""
        for src in self._sources:
            if src.files is not None:
                src.files.check()

    def state_dict(self) -> dict:
        """{"epoch", "position", "data": {source name: identity}}; a mixture adds "sources": {name: {"epoch",
        "position", "windows"}}."""
        state: dict = {"epoch": self.epoch, "position": self.position,
                       "data": {src.name: src.identity for src in self._sources}}
        if len(self._sources) > 1:
            state["sources"] = {src.name: {"epoch": order.epoch, "position": order.position, "windows": n}
                                for src, order, n in zip(self._sources, self._orders, self._windows)}
        return state

    def load_state_dict(self, state: dict, allow_changes: Sequence[str] = (), checkpoint: str = "the checkpoint"
                        ) -> None:
        """Continue from ``state`` (of ``checkpoint``, for the errors); ValueError if the data's contents changed
        since (unless ``allow_changes``, train.allow_changes, names data, data.path or data.sources), or if a
        position lies past the data it counts (an edited or foreign state)."""
        names = [src.name for src in self._sources]
        saved = sorted(state.get("sources", {}))
        if (len(names) > 1 and saved != sorted(names)) or (len(names) == 1 and saved):
            raise ValueError(f"the checkpoint's data loader state has the sources {saved or 'of one data.path'}, "
                             f"and this run reads {sorted(names) if len(names) > 1 else 'one data.path'}; resume "
                             "with the checkpointed run's data.path / data.sources")
        changed = self._check_identity(state.get("data"), allow_changes)
        if not changed and not any(a.split(".")[0] == "data" for a in allow_changes):  # the windows it counted
            self._check_positions(state, checkpoint)
        if len(names) == 1:
            self._orders[0].epoch, self._orders[0].position = int(state["epoch"]), int(state["position"])
            return
        self._drawn = int(state["position"])
        for s, (name, order) in enumerate(zip(names, self._orders)):
            source = state["sources"][name]
            order.epoch, order.position = int(source["epoch"]), int(source["position"])
            self._windows[s] = int(source["windows"])

    def _check_positions(self, state: dict, checkpoint: str) -> None:
        """Every recorded position within its source's windows (a position equal to their number is an epoch's
        end), and a mixture's windows adding up to its draws."""
        mixture = len(self._sources) > 1
        at = [(src.name, state["sources"][src.name] if mixture else state, order.num_windows)
              for src, order in zip(self._sources, self._orders)]
        wrong = [f"{name!r} at position {pos['position']} of {n} windows" for name, pos, n in at
                 if not 0 <= int(pos["position"]) <= n or int(pos["epoch"]) < 0]
        if mixture and sum(int(pos["windows"]) for _, pos, _ in at) != int(state["position"]):
            wrong.append(f"{sum(int(pos['windows']) for _, pos, _ in at)} windows drawn from the sources and "
                         f"{state['position']} in all")
        if wrong:
            raise ValueError(f"{checkpoint} records the data loader past the data it was saved with "
                             f"({'; '.join(wrong)}), and the data's contents and data settings are unchanged: an "
                             "edited or foreign checkpoint; move it aside and resume from an earlier one")

    def _check_identity(self, saved: dict[str, str] | None, allow_changes: Sequence[str]) -> bool:
        """Whether the data's contents changed (deliberately: else ValueError) since the checkpoint."""
        if saved is None:
            logger.warning("the checkpoint records no identity of its data (written before identities were "
                           "recorded): a change of the data's contents since then is not detected")
            return False
        changed = [f"{src.name!r} {saved.get(src.name, '<none>')[:12]}... -> {src.identity[:12]}..."
                   for src in self._sources if saved.get(src.name) != src.identity]
        if not changed:
            return False
        key = "data.sources" if len(self._sources) > 1 else "data.path"
        what = f"the data's contents changed since the checkpoint ({'; '.join(changed)}: digests of the files)"
        if not any(a in _DATA_CHANGE_KEYS for a in allow_changes):
            raise ValueError(f"resuming would change what is trained: {what}; resume with the data the run was "
                             f"trained on, or make the change deliberate with train.allow_changes=[{key}]")
        logger.warning("%s; resuming anyway (train.allow_changes): the loader's position counts windows of the new "
                       "data", what)
        return True


def _check_trained_tokens(cfg: DataConfig, path: str | Path, ids: np.ndarray, mask: np.ndarray, tokenizer: str,
                          untrained: tuple[int, ...] = ()) -> None:
    """Raise ValueError if the tokenized corpus (fresh or cached) trains nothing, or (almost) only special tokens,
    under ``data.mask_non_assistant``; ``untrained``: ids never trained (an image's tokens)."""
    if mask.size == 0:
        raise ValueError(f"data.path={path} holds no documents (e.g. a jsonl file of blank lines); add documents or "
                         "point data.path at the right file")
    if cfg.mask_non_assistant and not mask.any():
        raise ValueError(f"data.path={path}: no assistant message anywhere: with data.mask_non_assistant=true nothing "
                         "would be trained; add assistant turns or set data.mask_non_assistant=false")
    labels = ids[mask.astype(bool)] if cfg.mask_non_assistant else ids
    if untrained:
        labels = labels[~np.isin(labels, untrained)]
    specials = special_tokens(tokenizer)
    special = labels >= min(specials.values())  # a Qwen vocabulary's special tokens follow all of its BPE ids
    share = float(special.mean())
    if share > SPECIAL_ONLY_SHARE and not cfg.allow_special_only:
        seen = set(np.unique(labels[special]).tolist())
        names = ", ".join(sorted(name for name, i in specials.items() if i in seen))
        raise ValueError(f"data.path={path}: {share:.1%} of the {labels.size:,} trained tokens are special tokens "
                         f"({names}): the documents (or, with data.mask_non_assistant, the assistant messages) are "
                         "(almost) empty; check the data, or set data.allow_special_only=true to train on it anyway")


def _token_sources(cfg: DataConfig, tokenizer: str | None, model_vocab_size: int | None
                   ) -> tuple[list[Source], int, int | None]:
    """data=tokens: each source's shards, the vocabulary size they need and the id ending documents (data.eos_id,
    else the <|endoftext|> of the tokenizer their manifest names)."""
    sources, vocab_size, tokenized_by = [], 0, {}
    configs = cfg.sources or [SourceConfig(path=cfg.path)]
    for (key, path), name, src in zip(token_paths(cfg), source_names(configs), configs):
        data = load_token_stream(path, cfg.bin_dtype, cfg.cache_dir, key, model_vocab_size)
        if cfg.mask_non_assistant and data.mask is None:
            raise ValueError(f"data.mask_non_assistant=true needs a loss mask, and {key}={path} holds plain ids; "
                             "tokenize chat data with scripts/pretokenize.py (its shards carry the mask) or set "
                             "data.mask_non_assistant=false")
        if cfg.mask_non_assistant and not data.mask.any():
            raise ValueError(f"{key}={path}: every label of its shards is masked (no assistant message anywhere): "
                             "with data.mask_non_assistant=true its windows would train nothing; tokenize data with "
                             "assistant turns, or set data.mask_non_assistant=false")
        if data.tokenizer is not None:
            if tokenizer is not None and data.tokenizer != tokenizer:
                raise ValueError(f"{key}={path} was tokenized with {data.tokenizer} (its manifest.json) and the "
                                 f"model's tokenizer is {tokenizer}: set model.tokenizer={data.tokenizer} or "
                                 f"re-tokenize with scripts/pretokenize.py --tokenizer {tokenizer}")
            tokenized_by[key] = data.tokenizer
        sources.append(Source(name, data.ids, data.mask if cfg.mask_non_assistant else None, src.weight,
                              data.identity, data.files))
        vocab_size = max(vocab_size, data.vocab_size)
    if len(set(tokenized_by.values())) > 1:
        raise ValueError(f"data.sources were tokenized with different tokenizers ({tokenized_by}); mix sources of "
                         "one vocabulary")
    eos_id = cfg.eos_id
    if eos_id is None and tokenized_by:
        eos_id = special_tokens(next(iter(tokenized_by.values())))["<|endoftext|>"]
    return sources, vocab_size, eos_id


def _data_vision(cfg: DataConfig, vision: VisionData | None) -> VisionData | None:
    """The model's ``vision`` with data.max_image_pixels and the resize overrides data.image_min_pixels /
    data.image_max_pixels applied; ValueError names them for a model without a vision tower."""
    keys = [f"data.{k}" for k in ("image_min_pixels", "image_max_pixels") if getattr(cfg, k) is not None]
    if vision is None:
        if keys:
            raise ValueError(f"{', '.join(keys)} resize the images of chats, and the model has no vision tower to "
                             "read them; unset them")
        return None
    processing = vision.processing
    processing = dataclasses.replace(processing, min_pixels=cfg.image_min_pixels or processing.min_pixels,
                                     max_pixels=cfg.image_max_pixels or processing.max_pixels)
    if processing.min_pixels > processing.max_pixels:
        raise ValueError(f"{' and '.join(keys)} leave images between {processing.min_pixels:,} and "
                         f"{processing.max_pixels:,} pixels (the model's image processor: {vision.processing.min_pixels:,}"
                         f" .. {vision.processing.max_pixels:,}): min above max; set both")
    return dataclasses.replace(vision, processing=processing, max_image_pixels=cfg.max_image_pixels)


def build_data_loader(cfg: DataConfig, *, seed: int, local_batch_size: int, dp_rank: int, dp_size: int,
                      tokenizer: str | None = "qwen3", model_vocab_size: int | None = None,
                      vision: VisionData | None = None) -> PackedLoader:
    """Validate ``cfg``, load (tokenizing with ``tokenizer``, the model's, and caching on first use) the corpus, and
    return dp rank's loader; with ``data.val_fraction``, its ``validation`` holds the held-out part (else None).
    ``tokenizer`` (a training.data.tokenizer vocabulary) is unused by pre-tokenized data, whose shards are checked
    against ``model_vocab_size`` (the model's) where given. ``vision``: the model's vision side
    (``training.data.vision.vision_for_model``), for a model with a vision tower; None refuses data with images."""
    validate_data_config(cfg)
    vision = _data_vision(cfg, vision)
    if cfg.name != "tokens" and tokenizer not in TOKENIZERS:
        raise ValueError(f"data.name={cfg.name} tokenizes its text with the model's tokenizer, and model.tokenizer "
                         f"gives {tokenizer!r}: choose one of {', '.join(TOKENIZERS)} (or pre-tokenized data=tokens)")
    if local_batch_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need local_batch_size > 0 and 0 <= dp_rank < dp_size, got "
                         f"local_batch_size={local_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
    if cfg.eos_id is not None and model_vocab_size is not None and cfg.eos_id >= model_vocab_size:
        raise ValueError(f"data.eos_id={cfg.eos_id} is outside the model's vocabulary (model.arch.vocab_size="
                         f"{model_vocab_size}), so no token would end a document: set data.eos_id to the id that "
                         "ends the data's documents, or null for none")
    run_vision = None  # a corpus with images: its batches are multimodal
    if cfg.name == "tokens":
        sources, vocab_size, eos_id = _token_sources(cfg, tokenizer, model_vocab_size)
    else:
        corpus = tokenized_corpus(cfg, tokenizer, vision if cfg.name == "jsonl" else None)
        ids, mask = corpus.stream
        images = None
        if corpus.images:
            run_vision = vision
            images = Images.of(ids, corpus.images, vision, str(cfg.path))
        _check_trained_tokens(cfg, cfg.path or source_path(cfg), ids, mask, tokenizer,
                              run_vision.token_ids if run_vision else ())
        sources = [Source(cfg.name, ids, mask if cfg.mask_non_assistant else None, identity=corpus.source_sha256,
                          images=images)]
        tok = QwenTokenizer(tokenizer)
        vocab_size, eos_id = tok.vocab_size, tok.eos_id  # data text cannot forge it: eos ends documents only
    doc_eos_id = eos_id if cfg.document_mask else None  # what restarts position ids
    validation = None
    if cfg.val_fraction:
        if eos_id is None:
            raise ValueError("data.val_fraction holds out whole documents, and data=tokens knows none without "
                             "data.eos_id: set data.eos_id (the id that ends a document)")
        sources, held_out = zip(*(hold_out(src, cfg.val_fraction, eos_id) for src in sources))
        validation = ValidationSet(list(held_out), seq_len=cfg.seq_len, eos_id=doc_eos_id,
                                   local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                   vision=run_vision)
    loader = PackedLoader(list(sources), seq_len=cfg.seq_len, vocab_size=vocab_size, seed=seed,
                          local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                          eos_id=doc_eos_id, vision=run_vision)
    loader.validation = validation
    return loader
