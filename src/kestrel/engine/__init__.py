"""The engine: requests -> scheduler (pure Python) -> runner (owns the device) -> outputs."""
