"""Data model, controls, hub and sinks: imports neither torch nor textual."""
