"""The training engine: imports torch, never textual."""
