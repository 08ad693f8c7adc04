"""Constants shared across the layers (kernels, training and tests read the same values)."""

from __future__ import annotations

IGNORE_INDEX = -100  # a label that is not trained: no loss, no gradient (as transformers and F.cross_entropy)
