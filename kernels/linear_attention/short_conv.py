"""DeltaNet's short convolution in plain PyTorch: a depthwise causal convolution over a window of W taps, then silu,
restarting at every packed document (a document's window starts empty, as in a row of its own).

``causal_conv1d_silu`` is the torch reference of the ``causal_conv1d_silu`` kernel slot; ``kernels/registry.py`` can
put flash-linear-attention's Triton kernel (``kernels/linear_attention/fla.py``) in its place. Letters: F the conv
channels, W the window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.attention import Documents

Tensor = torch.Tensor


def causal_conv1d(x_BTF: Tensor, w_FW: Tensor, doc_ids_BT: Tensor | None) -> Tensor:
    """``y_t = sum_j w[:, W-1-j] * x_{t-j}`` (``nn.Conv1d``'s taps, causal), with only the taps inside t's document
    when ``doc_ids_BT`` is given."""
    T, W = x_BTF.shape[1], w_FW.shape[1]
    if doc_ids_BT is None:
        # Padded on both sides by W - 1 and cut to the first T outputs, which makes it causal.
        y_BFT = F.conv1d(x_BTF.transpose(1, 2), w_FW[:, None], padding=W - 1, groups=w_FW.shape[0])
        return y_BFT[..., :T].transpose(1, 2)
    y_BTF = x_BTF * w_FW[:, W - 1]
    for j in range(1, W):  # tap j reads the token j back, if it is in the same document
        same_BT = F.pad((doc_ids_BT[:, j:] == doc_ids_BT[:, :-j]).to(x_BTF.dtype), (j, 0))[:, :T]
        y_BTF = y_BTF + F.pad(x_BTF, (0, 0, j, 0))[:, :T] * w_FW[:, W - 1 - j] * same_BT[..., None]
    return y_BTF


def causal_conv1d_silu(x_BTF: Tensor, w_FW: Tensor, docs: Documents | None) -> Tensor:
    """silu(causal_conv1d): DeltaNet's q, k and v before the delta rule; ``docs``: the batch's packed documents."""
    return F.silu(causal_conv1d(x_BTF, w_FW, None if docs is None else docs.ids_BT))
