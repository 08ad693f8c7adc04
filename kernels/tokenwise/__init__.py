"""The decoder layers' per-token ops: RMS norms (``norm``), rotary (``rotary``), SwiGLU (``swiglu``), each a torch
reference beside its Triton kernel (``triton_norm``, ``triton_rotary``, ``triton_swiglu``); ``npu``: torch_npu's fused
ops for all three."""
