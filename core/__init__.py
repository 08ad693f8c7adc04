"""The bottom layer, importable from every other: the device module (``device``), shared constants
(``constants``) and the streaming safetensors writer (``safetensors_stream``). Imports nothing of the project."""
