"""Regenerate the screenshots in this folder from the running app, training the demos for real.

    python screenshots/take.py            # SVG from Textual's save_screenshot(), PNG by rsvg-convert
    python screenshots/take.py planner    # only the screenshots named

PNGs need `rsvg-convert` (Debian: librsvg2-bin). rsvg ignores SVG's textLength and collapses
leading spaces, so a glyph missing from the monospace font (braille) would be drawn with a
proportional fallback and shift the rest of its line; every text run is split into one <text>
per character first, which keeps each character in its cell.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from gputui.launch import run_script  # noqa: E402
from gputui.telemetry import hub as hubs  # noqa: E402
from gputui.tui import planned  # noqa: E402
from gputui.tui.app import GputuiApp  # noqa: E402
from gputui.tui.sources import LocalSource  # noqa: E402


async def wait(pilot, condition, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo did not get there in time")
        await pilot.pause(0.1)


async def shoot(name: str, demo: str, args: list[str], size: tuple[int, int], scene) -> Path:
    hub = hubs.Hub()
    hubs.install(hub)
    script = str(ROOT / "demos" / demo)
    app = GputuiApp(LocalSource(hub), script=demo, refresh=8, runner=lambda err: run_script(script, args, err=err))
    async with app.run_test(size=size) as pilot:
        await scene(app, pilot, hub)
        await pilot.pause(0.3)
        app.save_screenshot(f"{name}.svg", str(HERE))
        hub.controls.request("stop")
    if app.training_thread is not None:
        app.training_thread.join(60)
    hubs.install(None)
    return HERE / f"{name}.svg"


def steps(app, n: int):
    return lambda: app.view.latest is not None and app.view.latest.step >= n


async def main_scene(app, pilot, hub) -> None:
    await wait(pilot, steps(app, 60))
    await pilot.press("f")
    await wait(pilot, steps(app, 140))
    await pilot.press("c")
    await wait(pilot, steps(app, 240))


async def oom_scene(app, pilot, hub) -> None:
    """The dialog once its table is there (each remedy's predicted peak), as the user reads it."""
    await wait(pilot, lambda: app.view.waiting_oom is not None)
    await wait(pilot, lambda: app.view.plan is not None and app.view.plan.step >= app.view.waiting_oom.step)
    await pilot.pause(0.5)


async def top_scene(app, pilot, hub) -> None:
    await wait(pilot, steps(app, 20))
    await pilot.press("t")
    await wait(pilot, lambda: app.view.top is not None)


async def planner_scene(app, pilot, hub) -> None:
    await wait(pilot, steps(app, 20))
    asked = app.view.plans
    await pilot.press("w")
    await wait(pilot, lambda: app.view.plans > asked and app.view.plan.get("complete") and planned.fresh(app.view))


async def help_scene(app, pilot, hub) -> None:
    await wait(pilot, steps(app, 5))
    await pilot.press("question_mark")


async def shoot_torchrun(name: str, size: tuple[int, int]) -> Path:
    """demos/mlp.py on two ranks under torchrun (headless, each rank its socket), and the screen
    `gputui attach` shows for rank 0: the Ranks panel with both."""
    from gputui.telemetry.client import Mirror
    from gputui.tui.remote import RemoteSource

    runtime = tempfile.mkdtemp()
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    demo = [str(ROOT / "demos" / "mlp.py"), "--steps", "100000", "--memory-budget", "10MiB"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # torchrun reports the Ctrl-C at length
    job = subprocess.Popen([*command, *demo], env=env, start_new_session=True, **quiet)
    try:
        rank0 = None
        deadline = time.monotonic() + 120
        while rank0 is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the torchrun job never served its sockets")
            time.sleep(0.5)
            listing = subprocess.run(
                [sys.executable, "-m", "gputui", "jobs", "--json"], env=env, capture_output=True, text=True
            )
            rows = json.loads(listing.stdout or "[]")
            rank0 = next((r for r in rows if r.get("rank") == 0 and r.get("world_size") == 2), None)
        mirror = Mirror(rank0["socket"], rank0["pid"], control=False).start()
        app = GputuiApp(RemoteSource(mirror, control=False), script="", refresh=8)
        app.view.remote = True
        async with app.run_test(size=size) as pilot:
            await wait(pilot, lambda: app.view.latest is not None and app.view.latest.step >= 300)
            await pilot.pause(0.3)
            app.save_screenshot(f"{name}.svg", str(HERE))
        mirror.stop()
    finally:
        os.killpg(job.pid, signal.SIGINT)  # a Ctrl-C: every rank stops after the same step
        job.wait(60)
        shutil.rmtree(runtime, ignore_errors=True)
    return HERE / f"{name}.svg"


def per_character(svg: str) -> str:
    """Split each <text> run into one <text> per character, each at its cell's x."""

    def split(match: re.Match[str]) -> str:
        attrs, body = match.group(1), match.group(2)
        chars = re.findall(r"&#?\w+;|.", body)
        if not chars or "textLength" not in attrs:  # the window title: centred, left whole
            return match.group(0)
        x = float(re.search(r'\bx="([\d.]+)"', attrs).group(1))
        step = float(re.search(r'\btextLength="([\d.]+)"', attrs).group(1)) / len(chars)
        rest = re.sub(r'\s(x|textLength)="[\d.]+"', "", attrs)
        return "".join(
            f'<text{rest} x="{x + i * step:.2f}" textLength="{step:.2f}">{c}</text>'
            for i, c in enumerate(chars)
            if c not in (" ", "&#160;")
        )

    return re.sub(r"<text([^>]*)>([^<]*)</text>", split, svg)


def to_png(svg_path: Path) -> None:
    tool = shutil.which("rsvg-convert")
    if tool is None:
        print("rsvg-convert not found (Debian: apt install librsvg2-bin): SVG only", file=sys.stderr)
        return
    fixed = svg_path.with_suffix(".tmp.svg")
    fixed.write_text(per_character(svg_path.read_text(encoding="utf-8")), encoding="utf-8")
    try:
        subprocess.run([tool, str(fixed), "-o", str(svg_path.with_suffix(".png"))], check=True)
    finally:
        fixed.unlink()


async def take_all(names: list[str]) -> None:
    """Every screenshot, or those in `names`."""
    shots = [
        ("main", "gpt.py", ["--steps", "400", "--batch", "48", "--memory-budget", "40MiB"], (120, 40), main_scene),
        (
            "own-loop",
            "train_gpt.py",
            ["--steps", "300", "--eval-interval", "25", "--out", tempfile.mkdtemp(prefix="gputui-shot-")],
            (120, 40),
            lambda app, pilot, hub: wait(pilot, steps(app, 110)),
        ),
        ("main-80x24", "mlp.py", ["--steps", "600"], (80, 24), lambda app, pilot, hub: wait(pilot, steps(app, 150))),
        ("oom-dialog", "mlp.py", ["--memory-budget", "12MiB", "--manual"], (100, 30), oom_scene),
        ("top-tensors", "gpt.py", ["--steps", "400"], (100, 30), top_scene),
        ("help", "gpt.py", ["--steps", "400"], (100, 34), help_scene),
        (
            "planner",
            "gpt.py",
            ["--steps", "400", "--batch", "48", "--memory-budget", "40MiB"],
            (120, 30),
            planner_scene,
        ),
    ]
    for name, demo, args, size, scene in shots:
        if names and name not in names:
            continue
        svg = await shoot(name, demo, args, size, scene)
        to_png(svg)
        print(f"wrote {svg.relative_to(ROOT)}")
    if not names or "torchrun-attach" in names:
        svg = await shoot_torchrun("torchrun-attach", (120, 40))
        to_png(svg)
        print(f"wrote {svg.relative_to(ROOT)}")


if __name__ == "__main__":
    os.chdir(ROOT)
    asyncio.run(take_all(sys.argv[1:]))
