"""Document-causal attention over packed documents (the ``document_attention`` op): ``attention``, the dense-mask
torch reference and torch's FlexAttention and varlen kernels; ``cudnn_attention``, cuDNN's ragged SDPA."""
