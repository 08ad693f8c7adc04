"""The LM head and its loss: the chunked linear cross-entropy with its torch step (``linear_cross_entropy``), beside
the Triton step (``triton_cross_entropy``)."""
