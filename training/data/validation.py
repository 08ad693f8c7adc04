"""The fixed validation batches of the held-out data (``data.val_fraction``)."""

from __future__ import annotations

import numpy as np
import torch

from training.data.packing import Source, packed_batch
from training.data.vision import VisionData


class ValidationSet:
    """The held-out windows of every source, in order, cut into global batches like the training ones; a dp rank's
    rows of the first n batches are the same whatever the layout with the same global batch."""

    def __init__(self, sources: list[Source], *, seq_len: int, eos_id: int | None, local_batch_size: int,
                 dp_rank: int, dp_size: int, vision: VisionData | None = None) -> None:
        self._sources, self._seq_len, self._eos_id, self._vision = sources, seq_len, eos_id, vision
        counts = [src.num_windows(seq_len) for src in sources]
        self._source_W = np.repeat(np.arange(len(sources)), counts)
        self._window_W = np.concatenate([np.arange(c) for c in counts])
        self._local, self._global, self._offset = local_batch_size, local_batch_size * dp_size, \
            dp_rank * local_batch_size

    @property
    def num_batches(self) -> int:
        return len(self._window_W) // self._global

    def batches(self, n: int) -> list[dict[str, torch.Tensor]]:
        """This rank's rows of the first ``n`` global batches."""
        if n > self.num_batches:
            raise ValueError(f"train.eval_batches={n} global batches of validation need {n * self._global} windows "
                             f"of data.seq_len={self._seq_len}, and the held-out data has {len(self._window_W)}; "
                             "raise data.val_fraction or lower train.eval_batches")
        rows = [k * self._global + self._offset + np.arange(self._local) for k in range(n)]
        return [packed_batch(self._sources, self._source_W[r], self._window_W[r], self._seq_len, self._eos_id,
                             self._vision) for r in rows]
