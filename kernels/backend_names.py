"""The attention backends' names, importable without torch: ``get_backend`` takes them, the CLI offers them."""

BACKEND_NAMES = ("torch", "cpu", "triton", "flash-attn")
