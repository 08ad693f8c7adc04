"""The MoE dispatch path: token permutes and their K-to-one gathers (``permute``, beside ``triton_permute``) and the
experts' grouped GEMM (``grouped_mm``); ``npu``: torch_npu's fused permute / unpermute and grouped matmul."""
