"""The model: its parameter layout, FLOPs and bytes, per-device memory, and the controller's buffer counts."""
