"""The bottom layer with ``core``: device kernels, each beside its exact torch reference, grouped by what they serve:

- ``tokenwise``: the per-token ops of the decoder layers (RMS norms, rotary, SwiGLU); ``triton_*`` and ``npu``
- ``attention``: document-causal attention (the dense-mask reference, FlexAttention, varlen) and cuDNN's ragged SDPA
- ``linear_attention``: DeltaNet's gated delta rule and short convolution; ``triton_short_conv`` and the
  flash-linear-attention plugin (``fla``, ``fla_dqkwg``)
- ``moe``: the dispatch path's token permutes and the experts' grouped GEMM; ``triton_permute`` and ``npu``
- ``float8``: the experts' FP8 grouped GEMM (``train.float8``), fused with the dispatch gather (``triton_permute``),
  and the measured table that decides what runs in FP8
- ``loss``: the chunked LM head with its cross-entropy step; ``triton_cross_entropy``
- ``optim``: the gradient hand-off's cast and the AdamW update; ``triton_cast``, ``triton_adamw``
- ``comm``: a collective's link time in the loopback world (the clock it starts at, the hold of its stream); ``triton_link``

At this level only what every group shares: ``registry`` chooses one implementation of every op per device type
from ``kernel_config`` (``config``); ``installed`` holds the dispatch path's choices. Imports only ``core``; kept
import-free: the models import from here."""
