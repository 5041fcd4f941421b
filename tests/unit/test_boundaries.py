"""The layering DESIGN.md asks for: the CLI and telemetry start without torch; the core never loads textual."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # each test imports in a fresh interpreter


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print('\\n' + ' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {name.split(".")[0] for name in out.splitlines()[-1].split()}


@pytest.mark.parametrize(
    "module",
    [
        "gputui",
        "gputui.cli",
        "gputui.units",
        "gputui.launch",
        "gputui.telemetry.hub",
        "gputui.telemetry.controls",
        "gputui.telemetry.progress",
        "gputui.telemetry.jsonl",
        "gputui.telemetry.describe",
        "gputui.telemetry.history",
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


@pytest.mark.parametrize(
    "module", ["gputui.engine.fit", "gputui.plan", "gputui.step.sizing", "gputui.probes.device", "gputui.probes.cuda"]
)
def test_engine_and_probes_never_import_textual(module):
    loaded = modules_after(f"import {module}")
    assert "torch" in loaded and "textual" not in loaded


@pytest.mark.parametrize("module", ["gputui.tui.app", "gputui.tui.screens"])
def test_the_tui_never_imports_torch(module):
    loaded = modules_after(f"import {module}")
    assert "textual" in loaded and "torch" not in loaded


def test_the_view_model_needs_neither():
    loaded = modules_after("import gputui.tui.view, gputui.tui.sources, gputui.telemetry.output")
    assert "textual" not in loaded and "torch" not in loaded
