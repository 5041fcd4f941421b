"""Signals, dying terminals, stdin, stdout and saves, on real processes in real pseudo-terminals.

Each run ends as headless would: the fit stops after its step, the script's save runs, the
metrics file gets its end record, the socket goes, and the process exits with the script's code.
"""

import json
import os
import signal
import subprocess
import sys
import termios
import textwrap

import pytest
from process import Terminal, gputui, screens, socket_of, wait_until

from gputui.telemetry.client import Connection
from gputui.telemetry.output import LINE_LIMIT

TRAIN = """
import sys, time
import gputui, torch
from torch import nn

{before}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
data = [(torch.randn(8, 8), torch.randint(2, (8,))) for _ in range(50)]

def step(model, batch):
    time.sleep(0.02)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

result = gputui.fit(model, data, step, torch.optim.SGD(model.parameters(), lr=0.1), max_steps={steps})
gputui.save({{"steps": result.steps, "stopped": result.stopped, "big": torch.ones(1 << 20)}}, sys.argv[1])
{after}
sys.exit(3)
"""


def write_script(tmp_path, steps=100_000, before="", after=""):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(TRAIN.format(steps=steps, before=before, after=after)))
    return path


class Tui(Terminal):
    """`gputui run --metrics m.jsonl SCRIPT out.pt` on a pseudo-terminal (`tui` starts it), and what it leaves."""

    def records(self):
        text = self.metrics.read_text() if self.metrics.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def wait_steps(self, n):
        self.wait_for(lambda: sum(r["kind"] == "step" for r in self.records()) >= n, every=0.05)

    def assert_ended_cleanly(self, stopped):
        import torch

        end = self.records()[-1]
        assert end["kind"] == "end" and end["stopped"] == stopped and end["error"] is None
        saved = torch.load(self.out)
        assert saved["stopped"] == stopped and saved["steps"] == end["steps"] and saved["big"].sum() == 1 << 20
        assert os.listdir(self.sockets) == [], "the socket is removed"
        assert not [p for p in os.listdir(self.out.parent) if p.endswith("gputui-tmp")]


@pytest.fixture
def tui(env, tmp_path, processes):
    """Starts `gputui run` on a pseudo-terminal (optionally under a shell command): a Tui."""

    def start(script, shell=None, args=()):
        metrics, out = tmp_path / "m.jsonl", tmp_path / "out.pt"
        argv = [sys.executable, "-m", "gputui", "run", "--metrics", metrics, script, out, *args]
        if shell is not None:
            argv = ["/bin/sh", "-c", shell + ' "$@"', "sh", *argv]
        run = processes.terminal(argv, env, kind=Tui)
        run.metrics, run.out = metrics, out
        run.sockets = os.path.join(env["XDG_RUNTIME_DIR"], "gputui")
        return run

    return start


def test_sigterm_in_the_tui_finishes_the_step_saves_and_gives_the_terminal_back(tmp_path, tui):
    run = tui(write_script(tmp_path))
    run.wait_steps(3)
    os.kill(run.pid, signal.SIGTERM)
    assert run.exit_code() == 3
    run.assert_ended_cleanly("terminated")
    attrs = termios.tcgetattr(run.master)
    assert attrs[3] & termios.ICANON and attrs[3] & termios.ECHO, "the terminal is out of raw mode"
    run.wait_for(run.closed.is_set)
    assert run.screen.rfind(b"\x1b[?1049l") > run.screen.rfind(b"\x1b[?1049h"), "the alternate screen is left"


def test_a_second_sigterm_in_the_tui_stops_the_script_at_once(tmp_path, tui):
    # After fit, the script "evaluates" for minutes: the first SIGTERM ends fit, the second the script.
    after = f"open({str(tmp_path / 'evaluating')!r}, 'w').close()\nwhile True:\n    time.sleep(0.01)"
    run = tui(write_script(tmp_path, after=after))
    run.wait_steps(3)
    os.kill(run.pid, signal.SIGTERM)
    run.wait_for((tmp_path / "evaluating").exists)
    os.kill(run.pid, signal.SIGTERM)
    assert run.exit_code() == 143
    assert os.listdir(run.sockets) == []
    attrs = termios.tcgetattr(run.master)
    assert attrs[3] & termios.ICANON and attrs[3] & termios.ECHO


def test_a_terminal_that_dies_without_a_sighup_hands_over_to_headless(tmp_path, tui):
    # The session leader ignores HUP, so closing the terminal sends gputui no signal at all.
    run = tui(write_script(tmp_path, steps=60), shell="trap '' HUP;")
    run.wait_steps(3)
    run.hang_up()
    assert run.exit_code() == 3
    run.assert_ended_cleanly(None)
    assert run.records()[-1]["steps"] == 60, "training finished headless"


def test_the_script_reads_eof_from_stdin_and_the_keys_reach_the_app(tmp_path, tui):
    read, drawn = tmp_path / "read.txt", tmp_path / "drawn.txt"
    before = (
        f"open({str(read)!r}, 'w').write(repr(sys.stdin.read()))\n"
        f"open({str(drawn)!r}, 'w').write(repr(sorted(m for m in ('textual', 'rich') if m in sys.modules)))"
    )
    run = tui(write_script(tmp_path, before=before))
    run.wait_steps(2)
    assert read.read_text() == "''"
    assert drawn.read_text() == "[]", "the screen is drawn in a process of its own: no frame holds this one's GIL"
    run.send(b"q")  # asks: training is running
    run.wait_for(lambda: b"Stop after the current step" in run.screen)
    run.send(b"q")  # yes
    assert run.exit_code() == 3
    run.assert_ended_cleanly("requested")


def test_the_tui_prints_the_runs_summary_once_it_has_given_the_terminal_back(tmp_path, tui):
    run = tui(write_script(tmp_path))
    run.wait_steps(3)
    run.send(b"qq")  # quit, yes: the fit stops after its step, the script saves
    assert run.exit_code() == 3
    run.wait_for(run.closed.is_set)
    after = run.screen[run.screen.rfind(b"\x1b[?1049l") :].decode()  # on the terminal, the screen gone
    steps = run.records()[-1]["steps"]
    assert f"gputui: stopped (requested): {steps} steps, {8 * steps} samples in " in after, after
    assert "; micro-batch 8, amp off, checkpointing off" in after
    assert f"gputui: saved {run.out} (" in after


def test_headless_keeps_stdin(tmp_path, env):
    path = tmp_path / "echo.py"
    path.write_text("import sys\nprint('got', sys.stdin.read())\n")
    done = gputui("run", "--headless", path, input="hello", env=env)
    assert done.returncode == 0 and "got hello" in done.stdout, done.stderr


def test_a_second_ctrl_c_during_shutdown_is_quiet_and_the_socket_goes(tmp_path, env):
    # The second Ctrl-C lands exactly while the socket server closes.
    before = textwrap.dedent("""
        import os, signal
        from gputui.telemetry.server import TelemetryServer
        close = TelemetryServer.close
        def interrupted_close(self):
            os.kill(os.getpid(), signal.SIGINT)
            close(self)
        TelemetryServer.close = interrupted_close
    """)
    path = write_script(tmp_path, steps=4, before=before)
    metrics = tmp_path / "m.jsonl"
    done = gputui("run", "--headless", "--metrics", metrics, path, tmp_path / "out.pt", env=env)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert os.listdir(os.path.join(env["XDG_RUNTIME_DIR"], "gputui")) == []
    assert json.loads(metrics.read_text().splitlines()[-1])["kind"] == "end"


@pytest.mark.parametrize("how", [["python"], ["gputui", "run", "--headless"]])
def test_a_stop_signal_with_stderr_gone_still_finishes_the_step_and_saves(tmp_path, env, processes, how):
    """`python train.py 2>&1 | tee log`, then Ctrl-C: the terminal's SIGINT ends tee first, so the handler's
    "finishing the current step" goes to a closed pipe. Before, that write raised BrokenPipeError in
    whatever the handler interrupted (the step), and the run failed instead of stopping. Under `gputui
    run` the script's streams pass through gputui's own pump, whose writes were guarded already."""
    path, out = write_script(tmp_path, after="print('after the save', flush=True)"), tmp_path / "out.pt"
    sig = signal.SIGINT if how == ["python"] else signal.SIGTERM  # gputui run's own handler takes SIGTERM
    argv = [sys.executable, path, out] if how == ["python"] else [sys.executable, "-m", "gputui", *how[1:], path, out]
    proc = processes.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    wait_until(lambda: proc.stdout.readline().startswith(b"step "), message="no step", process=proc)
    proc.stderr.close()
    proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and b"after the save" in stdout, stdout[-2000:]
    import torch

    assert torch.load(out)["stopped"] == ("interrupted" if sig == signal.SIGINT else "terminated")


SLOW_SAVE = """
import os, sys, time
import gputui, torch

class Slow:
    '''Pickled inside the save: says so, then waits for the test's go.'''
    def __reduce__(self):
        open(sys.argv[2], "w").close()
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.01)
        return (str, ("slow",))

print("saving", flush=True)
gputui.save({"big": torch.ones(1 << 20), "slow": Slow()}, sys.argv[1])
print("after the save")
"""


def signal_mid_save(proc, sig, saving, go):
    """Send `sig` while SLOW_SAVE is held mid-write, then let the save go on; returns stdout, stderr."""
    wait_until(saving.exists, message="the script never got to its save", process=proc)
    proc.send_signal(sig)
    go.touch()
    return proc.communicate(timeout=60)


def assert_saved_whole(out):
    import torch

    saved = torch.load(out, weights_only=False)  # the test's own file: "slow" pickles as str("slow")
    assert saved["slow"] == "slow" and saved["big"].sum() == 1 << 20
    assert [p for p in os.listdir(out.parent) if p.endswith("gputui-tmp")] == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_save_waits_for_the_whole_file(tmp_path, processes, sig):
    import torch

    path, out, saving, go = tmp_path / "save.py", tmp_path / "model.pt", tmp_path / "saving", tmp_path / "go"
    path.write_text(SLOW_SAVE)
    torch.save({"old": True}, out)
    proc = processes.start(
        [sys.executable, path, out, saving, go],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # SIGINT as a terminal gives it: a suite started as a shell's `cmd &` passes it on ignored, and a plain
        # script that ignores it ignores it after its save too (as it would have; `gputui run` does not).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stdout, _ = signal_mid_save(proc, sig, saving, go)
    assert proc.returncode != 0 and "after the save" not in stdout, "the signal still ends the script"
    assert_saved_whole(out)


def held_save(tmp_path, tui):
    """The TUI running SLOW_SAVE, held mid-write; returns the run and the file that lets it go on."""
    path, saving, go = tmp_path / "save.py", tmp_path / "saving", tmp_path / "go"
    path.write_text(SLOW_SAVE)
    run = tui(path, args=(saving, go))
    run.wait_for(saving.exists)
    return run, go


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_in_the_tui_stops_the_script_once_its_save_is_whole(tmp_path, tui, sig):
    run, go = held_save(tmp_path, tui)
    os.kill(run.pid, sig)  # the first: the script finishes
    run.wait_for(lambda: b"Again" in run.screen)
    os.kill(run.pid, sig)  # the second: at once, but not mid-save
    run.wait_for(lambda: b"waiting for the save of " in run.screen)
    go.touch()
    assert run.exit_code() == 128 + sig
    assert_saved_whole(run.out)
    assert b"after the save" not in run.screen, "the stop lands right after the save"
    assert b"save.py printed (last 1 lines" in run.screen, "the terminal's stdout is back once the script ends"
    assert os.listdir(run.sockets) == []


def test_a_forced_quit_waits_for_the_save(tmp_path, tui):
    run, go = held_save(tmp_path, tui)
    run.send(b"q")  # asks: the script is running
    run.wait_for(lambda: b"Stop it and quit?" in run.screen)
    run.send(b"q")  # yes
    run.wait_for(lambda: b"q again" in run.screen)
    run.send(b"q")  # at once
    run.wait_for(lambda: b"waiting for the save of " in run.screen)
    go.touch()
    assert run.exit_code() == 130
    assert_saved_whole(run.out)
    assert b"after the save" not in run.screen and b"save.py printed (last 1 lines" in run.screen


def test_headless_sigint_during_a_save_stops_once_the_file_is_whole(tmp_path, env, processes):
    # Started ignoring SIGINT, as a shell script's `cmd &` does: gputui still stops on it, as fit and
    # the TUI do, instead of the save replaying it into the ignore.
    path, out, saving, go = tmp_path / "save.py", tmp_path / "model.pt", tmp_path / "saving", tmp_path / "go"
    path.write_text(SLOW_SAVE)
    argv = [sys.executable, "-m", "gputui", "run", "--headless", str(path), str(out), str(saving), str(go)]
    ignoring = (
        f"import os, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); os.execv({sys.executable!r}, {argv!r})"
    )
    proc = processes.start(
        [sys.executable, "-c", ignoring], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    stdout, stderr = signal_mid_save(proc, signal.SIGINT, saving, go)
    # ended by SIGINT, as python ends on a Ctrl-C it does not catch: the shell that started it stops too
    assert proc.returncode == -signal.SIGINT and "after the save" not in stdout, stderr
    assert "gputui: save.py interrupted" in stderr and "Traceback" not in stderr
    assert_saved_whole(out)


OWN_LOOP = """
import sys, time
import torch
from torch import nn

model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
steps = 0
try:
    while True:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        time.sleep(0.02)
except KeyboardInterrupt:
    torch.save({"steps": steps}, sys.argv[1])
    sys.exit(4)
"""


def test_sigterm_in_the_tui_interrupts_a_scripts_own_loop(tmp_path, tui):
    path = tmp_path / "own.py"
    path.write_text(OWN_LOOP)
    run = tui(path)
    run.wait_steps(3)
    os.kill(run.pid, signal.SIGTERM)
    assert run.exit_code() == 4
    import torch

    assert torch.load(run.out)["steps"] >= 3
    stopped = [r for r in run.records() if r.get("name") == "stopped"]
    assert stopped[0]["reason"].startswith("terminated: KeyboardInterrupt")
    assert run.records()[-1]["kind"] == "end" and os.listdir(run.sockets) == []


def screen_of(run):
    """The pid of the run's screen (`python -m gputui.tui`, its child), once it is there."""
    return run.wait_for(lambda: screens(run.pid))[0]


def assert_terminal_given_back(run):
    attrs = termios.tcgetattr(run.master)
    assert attrs[3] & termios.ICANON and attrs[3] & termios.ECHO, "the terminal is out of raw mode"


def test_a_ctrl_c_before_the_screen_is_up_stops_after_the_step_and_saves(tmp_path, tui):
    # The terminal is not raw yet: the Ctrl-C reaches the screen too, still starting. The run takes it.
    run = tui(write_script(tmp_path))
    screen_of(run)  # just started: importing textual, the terminal still cooked
    os.killpg(run.pid, signal.SIGINT)  # what the terminal does with a Ctrl-C: the whole foreground group
    assert run.exit_code() == 3
    run.assert_ended_cleanly("interrupted")
    assert_terminal_given_back(run)


def test_a_killed_screen_stops_the_script_and_the_terminal_is_given_back_whole(tmp_path, tui):
    run = tui(write_script(tmp_path))
    run.wait_steps(3)
    run.wait_for(lambda: b"\x1b[?1000h" in run.screen)  # the screen is up, the mouse reported
    os.kill(screen_of(run), signal.SIGKILL)
    assert run.exit_code() == 128 + signal.SIGKILL
    assert_terminal_given_back(run)
    run.wait_for(lambda: b"the screen was ended by signal 9" in run.screen)
    tail = run.screen[run.screen.rfind(b"\x1b[?1000h") :]
    assert b"\x1b[?1000l" in tail and b"\x1b[?1049l" in tail, "mouse reporting off, out of the alternate screen"
    assert run.records()[-1]["kind"] == "end", "the script unwound: fit wrote its end record"


def test_a_screen_whose_run_died_leaves(tmp_path, tui):
    import psutil

    # Under a shell that outlives the run, as a user's does: the terminal stays, with the shell on it.
    run = tui(write_script(tmp_path), shell='stay() { "$@"; sleep 60; }; stay')
    run.wait_steps(3)
    (gputui,) = [p for p in psutil.Process(run.pid).children() if "gputui" in " ".join(p.cmdline())]
    (screen,) = [p for p in gputui.children() if "gputui.tui" in " ".join(p.cmdline())]
    gputui.kill()
    screen.wait(10)  # it does not stay behind on a terminal whose keys go to the shell
    assert_terminal_given_back(run)


WRAP = """
import os, signal, sys
from gputui.cli import main
from gputui.tui import local

made = local._Screen.__init__


def stopped_twice_first(self, *args, **kwargs):  # two SIGTERMs land while the screen is being made
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    made(self, *args, **kwargs)


local._Screen.__init__ = stopped_twice_first
sys.exit(main(sys.argv[1:]))
"""


def test_two_stops_while_the_screen_is_made_end_the_run_before_the_script_starts(tmp_path, tui):
    wrap = tmp_path / "wrap.py"
    wrap.write_text(WRAP)
    run = tui(
        write_script(tmp_path, before="open(sys.argv[1] + '.started', 'w').close()"),
        shell=f'f() {{ shift 3; exec {sys.executable} {wrap} "$@"; }}; f',  # gputui run's arguments, wrapped
    )
    assert run.exit_code() == 128 + signal.SIGTERM
    assert not os.path.exists(f"{run.out}.started"), "the script never started: a second stop is at once"
    assert_terminal_given_back(run)


STREAMS = """
import os, sys, time

sys.stdout.reconfigure(line_buffering=True, encoding="utf-8")
print("text before")
sys.stdout.buffer.write(b"bytes between\\n")
sys.stdout.write("text after\\n")
sys.stderr.buffer.write("stderr bytes \\u00e9\\n".encode())
out = sys.stdout
print(out.encoding, out.errors, out.line_buffering, out.fileno(), out.isatty(), out.buffer.fileno())
os.write(1, b"B" * 2**20)  # as C code would: a megabyte, no newline
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
os.write(1, b"\\nfd done\\n")
"""


def test_the_scripts_streams_in_the_tui_are_text_over_bytes_and_fd_1_is_not_held_for_a_newline(tmp_path, env, tui):
    path = tmp_path / "streams.py"
    path.write_text(STREAMS)
    run = tui(path)
    lines = []
    with Connection(socket_of(env, run.pid), timeout=60) as conn:
        while (record := conn.read()) is not None:
            lines += record["lines"] if record["kind"] == "output" else []
            if record["kind"] == "output" and record["current"].startswith("B"):
                break
        assert record is not None, f"the job ended: {lines}; screen: {run.text()}"
        assert lines == ["text before", "bytes between", "text after", "stderr bytes é", "utf-8 strict True 1 False 1"]
        assert record["current"] == "B" * LINE_LIMIT + "…", "shown as it comes, cut as a print's line is"
        run.out.touch()
        while "fd done" not in lines and (record := conn.read()) is not None:
            lines += record["lines"] if record["kind"] == "output" else []
    assert lines[-2:] == ["B" * LINE_LIMIT + "…", "fd done"]
    run.send(b"q")
    assert run.exit_code() == 0
