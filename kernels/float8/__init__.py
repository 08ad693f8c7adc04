"""FP8 training (``train.float8=rowwise``): the experts' FP8 grouped GEMM (``grouped_mm``), fused with the dispatch
gather (``permute``, beside its Triton kernel ``triton_permute``), and the measured table (``table``, ``table.json``)
that decides which GEMMs run in FP8."""
