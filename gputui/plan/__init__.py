"""The planner: what one training step would hold at its peak under each remedy, traced on a fake copy
of the model before anything is allocated, and fit's what-if table and micro-batch pick made of it.

Its modules, each importing only those listed after it (pyproject.toml's contract): planner (fit's Planner:
requests, tables, the pick after an OOM), predictions (one run's, cached and corrected), table (the
remedies' rows), trace (predict(): one step traced), fake (the fake copy), counter (the dispatch mode
that counts), guard and kept (what the step's own code changed, put back), prediction (the result and
its errors), private (every private torch API used, and only there). It imports the step package and
the probes, never the engine.
"""

from .planner import Planner
from .prediction import PARTS, Prediction, Unsafe, Untraceable, estimate, line
from .predictions import NoPrediction
from .table import Setting
from .trace import predict

__all__ = [
    "PARTS",
    "NoPrediction",
    "Planner",
    "Prediction",
    "Setting",
    "Unsafe",
    "Untraceable",
    "estimate",
    "line",
    "predict",
]
