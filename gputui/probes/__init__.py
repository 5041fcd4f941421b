"""Memory readings. Each module imports its own backend (torch, pynvml, psutil); none imports textual."""

STEP_READ_S = 0.1
"""Seconds between the readings a probe makes after steps (step_reading): the screen redraws 4 times a
second, and each reading's peak covers the steps since the one before. On CUDA a reading and its peak
reset cost a launch-bound step on an H200 about 140 us (benchmarks/fit_cost.py); on a CPU, its key
and record cost a millisecond step several microseconds in place."""
