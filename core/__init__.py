"""The bottom layer, importable from every other: the device module (``device``), shared constants
(``constants``), the streaming safetensors writer (``safetensors_stream``) and the private torch APIs with their version
conditions (``torch_compat``). Imports nothing of the project."""
