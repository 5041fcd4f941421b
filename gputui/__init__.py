"""gputui: train PyTorch models in a terminal app that shows GPU memory live and fixes OOMs mid-run.

`import gputui` is cheap: `fit`, `Trainer`, `evaluate` and the results load the engine (and torch) on
first use, so the CLI and the attach client start without torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["fit", "Trainer", "StepResult", "evaluate", "FitResult", "FitError", "save", "__version__"]

# torch warns on import when NumPy is absent; gputui never needs NumPy, so the warning is noise.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

if TYPE_CHECKING:
    from .engine.evaluate import evaluate
    from .engine.fit import fit
    from .engine.result import FitError, FitResult
    from .engine.saving import save
    from .engine.trainer import StepResult, Trainer


def __getattr__(name: str) -> Any:
    if name == "fit":
        from .engine.fit import fit

        return fit
    if name in ("Trainer", "StepResult"):
        from .engine import trainer

        return getattr(trainer, name)
    if name == "evaluate":
        from .engine.evaluate import evaluate

        return evaluate
    if name == "save":
        from .engine.saving import save

        return save
    if name in ("FitResult", "FitError"):
        from .engine import result

        return getattr(result, name)
    raise AttributeError(f"module 'gputui' has no attribute {name!r}")
