"""What gputui itself costs: CLI start, attaching to a job, an attached TUI's CPU, the socket server,
and on CUDA reading the allocator a step and its memory history (a step recorded, a snapshot dumped).

A headless job (the tiny MLP through `gputui.fit`, as `python train.py` runs it) trains in the
background for the attach figures. Nothing here imports torch: the attach side must not need it
(the allocator's reads and the history figures are timed in child processes).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import harness

FULL = {"runs": 10, "cpu_s": 10.0, "samples": 5000, "frames": 60, "reads": 2000, "history_steps": 50}
QUICK = {"runs": 3, "cpu_s": 3.0, "samples": 300, "frames": 10, "reads": 200, "history_steps": 10}
PUBLISH_HZ = 500  # a 2 ms step
ROWS_PER_RECORD = 35  # a turn's steps (50 ms) at ~700 steps a second: the tiny MLP on one thread

READER = """
import sys
from gputui.telemetry.client import Connection
with Connection(sys.argv[1], timeout=None) as conn:
    steps = 0
    while (record := conn.read()) is not None:
        steps += len(record["rows"]) if record["kind"] == "steps" else 0
print(steps)
"""


HISTORY = """
import json, os, pickle, sys, time
import torch
if not torch.cuda.is_available():
    print(json.dumps({"skipped": sys.argv[3]}))
    sys.exit()
sys.path.insert(0, sys.argv[1])
import workloads
from gputui.probes import snapshot

steps, device = int(sys.argv[2]), torch.device("cuda", torch.cuda.current_device())
w = workloads.make("gpt", device="cuda")
opt = w.optimizer()

def step_ms(n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        w.step(w.model, w.batches[i % len(w.batches)]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / n

step_ms(5)
plain = step_ms(steps)
snapshot.start_history(w)
recorded = step_ms(steps)
saved = snapshot.dump(os.path.join(sys.argv[4], "history"), device, step=steps, reason="bench")
snapshot.stop_history(w)
with open(saved["path"], "rb") as f:
    entries = len(pickle.load(f)["device_traces"][device.index])
print(json.dumps({
    "gpu": torch.cuda.get_device_name(device), "workload": w.description, "steps": steps,
    "max_entries": snapshot.MAX_ENTRIES, "step_ms": plain, "recorded_step_ms": recorded,
    "dump_s": saved["seconds"], "entries": entries, "pickle_bytes": os.path.getsize(saved["path"]),
}))
"""


def history_cost(device: str, steps: int, tmp: str, env: dict[str, str]) -> dict[str, Any]:
    """On CUDA: a step of the GPT demo without and with memory history (gputui's settings: Python
    stacks, at most MAX_ENTRIES events), and a snapshot dumped after it (seconds, entries, bytes)."""
    if device == "cpu":
        return {"skipped": harness.NOT_MEASURED}
    done = subprocess.run(
        [sys.executable, "-c", HISTORY, harness.HERE, str(steps), harness.NOT_MEASURED, tmp],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode:
        raise RuntimeError(f"the memory history benchmark failed: {done.stderr[-1000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    return time.perf_counter() - t0, proc


def help_start(runs: int, env: dict[str, str]) -> dict[str, Any]:
    times = []
    for _ in range(runs):
        seconds, proc = timed([*harness.gputui_cmd(), "--help"], env)
        if proc.returncode or "usage: gputui" not in proc.stdout:
            raise RuntimeError(f"gputui --help failed: {proc.stderr[-500:]}")
        times.append(1e3 * seconds)
    check = (
        "import sys\nfrom gputui.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'textual', 'psutil') if m in sys.modules))"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
        .stdout.strip()
        .splitlines()[-1]
        .replace("'", '"')
    )
    return {"ms": harness.summary(times), "heavy_modules_loaded": loaded, "torch_imported": "torch" in loaded}


def allocator_reads(device: str, calls: int, runs: int, env: dict[str, str]) -> dict[str, Any]:
    """CPU time of one reading of the CUDA caching allocator, as a step pays it: `memory_stats()` (and
    `memory_allocated()`, which calls it) against the one nested read the probe makes, and the probe's
    whole reading. No GPU work is waited for: these are host-side calls. Skipped without CUDA."""
    argv = [sys.executable, os.path.join(harness.HERE, "allocator_reads.py"), device, str(calls), str(runs)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise RuntimeError(f"timing the allocator's reads failed: {done.stderr[-500:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name, value in out.items():
        if isinstance(value, list):
            out[name] = harness.summary(value)
    return out


def first_render(path: str, pid: int) -> float:
    """Seconds from making a RemoteSource to the app's first screen showing the job's step."""
    from gputui.telemetry.client import Mirror
    from gputui.tui.app import GputuiApp
    from gputui.tui.remote import RemoteSource

    async def go() -> float:
        t0 = time.perf_counter()
        mirror = Mirror(path, pid).start()
        try:
            app = GputuiApp(RemoteSource(mirror, control=False), script="", refresh=4)
            app.view.remote = True
            async with app.run_test(size=(120, 40)) as pilot:
                while app.view.latest is None:
                    await pilot.pause(0.005)
                await pilot.pause()  # the refresh that pull() asked for is painted
                return time.perf_counter() - t0
        finally:
            mirror.stop()

    return asyncio.run(go())


def frame_cost(sample: Any, history: int, per_frame: int, frames: int) -> dict[str, Any]:
    """CPU of one frame of the main screen (the pull and the paint it asks for) at 120x40, after a run
    of `history` steps, with `per_frame` new steps a frame (500 a second at 4 Hz): a frame must not
    cost more as the run grows."""
    import math
    from dataclasses import replace

    from gputui.telemetry.hub import Hub
    from gputui.telemetry.run import RunInfo
    from gputui.tui.app import GputuiApp
    from gputui.tui.sources import LocalSource

    def step(n: int) -> Any:
        return replace(sample, step=n, loss=2.0 * math.exp(-n / 5000) + 0.3 + 0.05 * math.sin(n))

    async def go() -> list[float]:
        hub = Hub()
        hub.start(RunInfo(mode="fit", device=sample.memory.device, argv=("train.py",), pid=os.getpid()))
        app = GputuiApp(LocalSource(hub), script="train.py", refresh=0.001)  # no timer: the loop pulls
        cpu: list[float] = []
        async with app.run_test(size=(120, 40)) as pilot:
            for n in range(1, history + 1):
                hub.publish(step(n))
                if n % 2000 == 0:
                    app.pull()
                    await pilot.pause()
            for frame in range(frames + 5):
                for n in range(history + frame * per_frame, history + (frame + 1) * per_frame):
                    hub.publish(step(n + 1))
                c0 = time.process_time()
                app.pull()
                await pilot.pause()
                if frame >= 5:  # the first frames after the history settle the layout
                    cpu.append(1e3 * (time.process_time() - c0))
        return cpu

    return {"history": history, "per_frame": per_frame, "ms": harness.summary(asyncio.run(go()))}


def attach_tui(pid: int, refresh: float, seconds: float, env: dict[str, str]) -> dict[str, Any]:
    """`gputui attach PID --refresh HZ` in a pseudo-terminal: time to the job on screen, then CPU use."""
    import psutil

    t0 = time.perf_counter()
    child = harness.PtyChild([*harness.gputui_cmd(), "attach", str(pid), "--refresh", str(refresh)], env)
    try:
        if not child.wait_for(lambda: f"pid {pid}".encode() in child.output, 30):
            raise RuntimeError(f"the attach TUI never showed the job: {child.text()[-1000:]}")
        shown = time.perf_counter() - t0
        child.wait_for(lambda: False, 1.0)  # settled: the first history and layout are behind it
        proc = psutil.Process(child.pid)
        before, w0 = proc.cpu_times(), time.perf_counter()
        child.wait_for(lambda: False, seconds)  # read the screen meanwhile, as a terminal does
        after, w1 = proc.cpu_times(), time.perf_counter()
    finally:
        child.stop(b"q")
    used = (after.user - before.user) + (after.system - before.system)
    return {
        "refresh_hz": refresh,
        "first_screen_s": shown,
        "cpu_pct": 100 * used / (w1 - w0),
        "cpu_s": used,
        "wall_s": w1 - w0,
    }


def server_cost(clients: int, samples: int, sample: Any, tmp: str, env: dict[str, str]) -> dict[str, Any]:
    """hub.publish() time on the training thread, and the server thread's CPU per sample."""
    import psutil

    from gputui.telemetry.hub import Hub
    from gputui.telemetry.run import RunInfo
    from gputui.telemetry.server import TelemetryServer

    hub = Hub()
    server = TelemetryServer(hub, path=os.path.join(tmp, f"cost-{clients}.sock")).start()
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, server.path],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(clients)
    ]
    try:
        harness.wait_until(lambda: server.clients == clients, 30)
        hub.start(RunInfo(pid=os.getpid(), argv=("bench",), device="cpu", device_name="CPU"))
        thread = next(t for t in psutil.Process().threads() if t.id == server._thread.native_id)
        cpu0 = thread.user_time + thread.system_time
        times, period, next_t = [], 1 / PUBLISH_HZ, time.perf_counter()
        for _ in range(samples):
            t0 = time.perf_counter()
            hub.publish(sample)
            times.append(time.perf_counter() - t0)
            next_t += period
            time.sleep(max(0.0, next_t - time.perf_counter()))
        time.sleep(3 * 0.05)  # the server's last ticks
        thread = next(t for t in psutil.Process().threads() if t.id == server._thread.native_id)
        cpu = thread.user_time + thread.system_time - cpu0
    finally:
        server.close()
        received = []
        for reader in readers:
            try:
                out, _ = reader.communicate(timeout=30)
                received.append(int(out.strip() or 0))
            except (subprocess.TimeoutExpired, ValueError):
                harness.kill_tree(reader.pid)
                reader.wait()
                received.append(None)
    us = [1e6 * t for t in times]
    return {
        "clients": clients,
        "samples": samples,
        "publish_us": harness.summary(us),
        "publish_us_p99": sorted(us)[int(0.99 * len(us))],
        "server_cpu_us_per_sample": 1e6 * cpu / samples,
        "received": received,
    }


def client_cost(sample: Any, steps: int) -> dict[str, Any]:
    """What a client (attach's Mirror, as the TUI's screen uses it) spends a step: read the line, parse
    and check it, make the sample and publish it into its hub. The job's side is a socket pair fed
    steps the server's way (a record a turn, ROWS_PER_RECORD rows), encoded before the clock starts."""
    import dataclasses
    import socket
    import threading

    from gputui.telemetry.client import Mirror
    from gputui.telemetry.protocol import encode
    from gputui.telemetry.sample import StepRecord

    rows = [StepRecord.of(dataclasses.replace(sample, step=n)).row() for n in range(1, steps + 1)]
    hello = {"kind": "hello", "pid": os.getpid(), "argv": ["bench"], "runs": 1, "info": None, "summary": None}
    stream = b"".join(
        [encode(hello), encode({"kind": "live"})]
        + [encode({"kind": "steps", "rows": rows[i : i + ROWS_PER_RECORD]}) for i in range(0, steps, ROWS_PER_RECORD)]
    )
    job, mine = socket.socketpair()
    mirror = Mirror("pair", None, sock=mine)
    cpu0 = time.process_time()
    mirror.start()
    feeder = threading.Thread(target=lambda: (job.sendall(stream), job.shutdown(socket.SHUT_WR)))
    feeder.start()
    mirror.done.wait(120)
    cpu = time.process_time() - cpu0
    feeder.join()
    job.close()
    received = mirror.hub.last_step()
    if received != steps:
        raise RuntimeError(f"the mirror published {received} steps of {steps}: {mirror.status}")
    return {
        "steps": steps,
        "rows_per_record": ROWS_PER_RECORD,
        "bytes_per_step": len(stream) / steps,
        "cpu_us_per_step": 1e6 * cpu / steps,
    }


def run(quick: bool, device: str) -> dict[str, Any]:
    config = QUICK if quick else FULL
    out: dict[str, Any] = {}
    with harness.scratch() as tmp:
        env = harness.child_env(tmp)
        os.environ["XDG_RUNTIME_DIR"] = env["XDG_RUNTIME_DIR"]  # this process finds the job's socket there
        from gputui.telemetry.client import Connection
        from gputui.telemetry.paths import socket_path

        out["help"] = help_start(config["runs"], env)
        print(f"tool costs: gputui --help {out['help']['ms']['median']:.0f} ms", file=sys.stderr)
        job = [
            sys.executable,
            os.path.join(harness.HERE, "workloads.py"),
            "--model",
            "mlp",
            "--loop",
            "fit",
            "--steps",
            str(10**7),
            "--warmup",
            "0",
            "--out",
            os.path.join(tmp, "job.json"),
        ]
        with harness.background(job, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
            path = socket_path(proc.pid)

            def latest() -> Any:
                if not os.path.exists(path):
                    return None
                with Connection(path) as conn:
                    return conn.welcome().latest

            sample = harness.wait_until(latest, 60, 0.05)
            attach = []
            for _ in range(config["runs"]):
                seconds, done = timed([*harness.gputui_cmd(), "attach", str(proc.pid), "--json"], env)
                if done.returncode or json.loads(done.stdout)["kind"] != "step":
                    raise RuntimeError(f"gputui attach --json failed: {done.stderr[-500:]}")
                attach.append(1e3 * seconds)
            out["attach_json_ms"] = harness.summary(attach)
            out["first_render_ms"] = harness.summary(
                [1e3 * first_render(path, proc.pid) for _ in range(max(2, config["runs"] // 2))]
            )
            out["frames"] = [frame_cost(sample, n, 125, config["frames"]) for n in (1000, 20_000)]
            out["attach_tui"] = [attach_tui(proc.pid, hz, config["cpu_s"], env) for hz in (4, 10)]
            print(
                f"tool costs: attach TUI CPU {[round(a['cpu_pct'], 1) for a in out['attach_tui']]} %", file=sys.stderr
            )
        out["server"] = [server_cost(n, config["samples"], sample, tmp, env) for n in (0, 1, 4)]
        out["client"] = client_cost(sample, 10 * config["samples"])
        out["allocator"] = allocator_reads(device, config["reads"], config["runs"], env)
        print(f"tool costs: allocator reads {out['allocator'].get('skipped', 'timed')}", file=sys.stderr)
        out["history"] = history_cost(device, config["history_steps"], tmp, env)
    return out


def markdown(r: dict[str, Any]) -> str:
    h = r["help"]
    lines = [
        "| what | time: median (min-max) |",
        "| --- | --- |",
        f"| `gputui --help` (process start to exit) | {harness.spread(h['ms'])} ms; torch imported: "
        f"{'**yes**' if h['torch_imported'] else 'no'} (loaded of torch, textual, psutil: {', '.join(h['heavy_modules_loaded']) or 'none'}) |",
        f"| `gputui attach PID --json` (process start to exit, the job's latest step printed) | "
        f"{harness.spread(r['attach_json_ms'])} ms |",
        f"| TUI first render of a job (`RemoteSource` in `App.run_test()`, 4 Hz: connect, first pull with a step, paint) | "
        f"{harness.spread(r['first_render_ms'])} ms |",
    ]
    for a in r["attach_tui"]:
        lines.append(
            f"| `gputui attach PID --refresh {a['refresh_hz']:g}` in a pseudo-terminal: start to the job on screen | "
            f"{a['first_screen_s'] * 1e3:.0f} ms |"
        )
    for f in r.get("frames", ()):
        lines.append(
            f"| a frame of the main screen at 120x40 after {f['history']:,} steps, {f['per_frame']} new a frame "
            f"(pull + paint, CPU) | {harness.spread(f['ms'])} ms |"
        )
    lines += [
        "",
        "CPU of an attached TUI client (its process's user + system time while the job trains):",
        "",
        "| refresh | CPU (% of one core) | measured over |",
        "| --- | --- | --- |",
    ]
    for a in r["attach_tui"]:
        lines.append(f"| {a['refresh_hz']:g} Hz | {a['cpu_pct']:.1f}% | {a['wall_s']:.1f} s |")
    lines += [
        "",
        f"Telemetry server, samples published at {PUBLISH_HZ} Hz (a 2 ms step): `hub.publish()` on the "
        "training thread (the server's sink only appends to a deque), and the server thread's CPU per sample "
        "(serializing once, writing to every client).",
        "",
        "| clients | publish: median (min-max) | publish p99 | server thread CPU per sample | samples received |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in r["server"]:
        got = ", ".join(str(x) for x in s["received"]) or "-"
        lines.append(
            f"| {s['clients']} | {harness.spread(s['publish_us'])} us | {harness.fmt(s['publish_us_p99'])} us | "
            f"{harness.fmt(s['server_cpu_us_per_sample'])} us | {got} of {s['samples']} |"
        )
    c = r.get("client")
    if c:
        lines += [
            "",
            f"A client's CPU a step (attach's Mirror, as the screen of `gputui run` uses it: read, parse, check, "
            f"publish into its hub), {c['steps']:,} steps fed through a socket pair {c['rows_per_record']} to a "
            f"record, as the server sends them at ~700 steps a second: **{harness.fmt(c['cpu_us_per_step'])} us** "
            f"({c['bytes_per_step']:.0f} bytes a step on the wire).",
        ]
    lines += ["", *allocator_lines(r.get("allocator"))]
    h = r.get("history")
    if h:
        lines += ["", history_line(h)]
    return "\n".join(lines) + "\n"


def allocator_lines(a: dict[str, Any] | None) -> list[str]:
    """The allocator's reads as a table, or the line that says why they were not timed."""
    if not a or "skipped" in a:
        why = a["skipped"] if a else "not run"
        return [f"Reading the CUDA caching allocator a step: {harness.NOT_MEASURED}; this run: {why}."]
    lines = [
        f"Reading the CUDA caching allocator, host CPU a call ({a['gpu']}, torch {a['torch']}; "
        f"`memory_stats()` flattens {a['keys']} keys):",
        "",
        "| call | us a call: median (min-max) |",
        "| --- | --- |",
    ]
    for name, what in (
        ("memory_stats", "`torch.cuda.memory_stats()`"),
        ("memory_allocated", "`torch.cuda.memory_allocated()` (calls memory_stats())"),
        ("memory_stats_as_nested_dict", "`torch.cuda.memory_stats_as_nested_dict()` (what the probe reads)"),
        ("probe.read", "`CudaProbe.read()`: a step's whole reading (device free and RSS at most once a second)"),
    ):
        lines.append(f"| {what} | {harness.spread(a[name])} |")
    return lines


def history_line(h: dict[str, Any]) -> str:
    if "skipped" in h:
        return f"CUDA memory history (`--memory-history`, `s`): {h['skipped']}."
    return (
        f"CUDA memory history on {h['gpu']} ({h['workload']}): a step takes {h['step_ms']:.1f} ms, "
        f"{h['recorded_step_ms']:.1f} ms while history is recorded (Python stacks, at most "
        f"{h['max_entries']:,} events); a snapshot dumped after {h['steps']} steps holds {h['entries']:,} "
        f"events, {h['pickle_bytes'] / 2**20:.1f} MiB, written in **{h['dump_s']:.2f} s** on the training thread."
    )


if __name__ == "__main__":
    harness.main(run, __doc__)
