"""DeltaNet's linear attention: the gated delta rule (``delta_rule``, the torch reference; ``fla`` puts
flash-linear-attention's Triton kernels in its place, ``fla_dqkwg`` the #640-safe backward step) and its short
convolution (``short_conv``, beside our Triton kernel ``triton_short_conv``)."""
