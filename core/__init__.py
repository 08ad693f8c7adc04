"""The bottom layer, importable from every other: the device module (``device``) and shared constants
(``constants``). Imports nothing of the project."""
