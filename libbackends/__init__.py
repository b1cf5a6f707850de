"""Backend contract and built-in backends."""
