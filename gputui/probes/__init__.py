"""Memory readings. Each module imports its own backend (torch, pynvml, psutil); none imports textual."""
