"""Device kernels, each with an exact torch reference: ``registry`` chooses them per device type from
``kernel_config`` (``config``); ``grouped_mm`` is the expert GEMM. Kept import-free: the models import from here."""
