"""What import-linter cannot see: the modules a fresh interpreter has loaded once it imported one of
gputui's, lazy imports, third-party imports and ignored edges included. What the contracts in
pyproject.toml already forbid (telemetry, the engine, the planner, the probes and the TUI) is not
checked again here."""

import pytest
from process import python

pytestmark = pytest.mark.process  # each test imports in a fresh interpreter


def modules_after(code: str) -> set[str]:
    done = python("-c", code + "\nimport sys; print('\\n' + ' '.join(sys.modules))")
    assert done.returncode == 0, done.stderr
    return {name.split(".")[0] for name in done.stdout.splitlines()[-1].split()}


@pytest.mark.parametrize(
    "module",
    [
        "gputui",
        "gputui.cli",
        "gputui.units",
        "gputui.launch",
        "gputui.engine.result",
        "gputui.probes.nvml",
        "gputui.watch",
        "gputui.interrupts",
    ],
)
def test_no_torch_no_textual(module):
    loaded = modules_after(f"import {module}")
    assert "torch" not in loaded and "textual" not in loaded


def test_help_does_not_import_torch():
    loaded = modules_after(
        "from gputui.cli import main\ntry:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass"
    )
    assert "torch" not in loaded


def test_the_view_model_needs_neither():
    loaded = modules_after("import gputui.tui.view, gputui.tui.sources, gputui.telemetry.output")
    assert "textual" not in loaded and "torch" not in loaded
