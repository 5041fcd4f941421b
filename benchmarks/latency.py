"""Control latency: from a request (`hub.controls.request`) to the loop applying it, and through the
socket as `gputui ctl` sends it (send to the answering event back at the client).

Requests come from another thread at random moments within the step (toggling auto-recover, which
changes nothing else), each after the previous one was answered. The event's `latency_s` is
measured by the loop; "steps" counts the steps completed between the request and its application
(1: applied at the very next step boundary).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from typing import Any

import harness

FULL = {"mlp": 200, "gpt": 60}  # requests per workload
QUICK = {"mlp": 30, "gpt": 10}


class Answers:
    """A hub sink handing each answering event to the thread waiting for it."""

    def __init__(self) -> None:
        self.events: dict[int, Any] = {}
        self.ready = threading.Condition()

    def on_event(self, event: Any) -> None:
        if "request_id" in event.details:
            with self.ready:
                self.events[event.details["request_id"]] = event
                self.ready.notify_all()

    def on_start(self, info: Any) -> None: ...
    def on_sample(self, sample: Any) -> None: ...
    def on_end(self, summary: Any) -> None: ...

    def wait(self, request_id: int, timeout: float = 30.0) -> Any:
        with self.ready:
            if not self.ready.wait_for(lambda: request_id in self.events, timeout):
                raise TimeoutError(f"request {request_id} was not answered in {timeout:.0f}s")
            return self.events.pop(request_id)


def measure(model: str, count: int, device: str, tmp: str) -> dict[str, Any]:
    from workloads import make

    import gputui
    from gputui.telemetry import hub as hubs
    from gputui.telemetry.client import Connection, wait_for_answer
    from gputui.telemetry.server import TelemetryServer

    hub = hubs.Hub()
    hubs.install(hub)
    answers = Answers()
    hub.add_sink(answers)
    server = TelemetryServer(hub, path=os.path.join(tmp, f"{model}.sock")).start()
    w = make(model, device=device)
    step_s: list[float] = []
    direct: list[tuple[float, int]] = []
    socket_s: list[float] = []
    failure: list[BaseException] = []

    def requester() -> None:
        try:
            rng = random.Random(0)
            harness.wait_until(lambda: (hub.latest() or None) and hub.latest().step >= 5, 120)
            t = [s.t for s in hub.samples()[-3:]]
            step_s.append((t[-1] - t[0]) / (len(t) - 1))
            value = False
            for _ in range(count):  # the API, in process
                time.sleep(rng.uniform(0, 1.5 * step_s[0]))
                before = hub.latest().step
                control = hub.controls.request("set_auto_recover", value)
                event = answers.wait(control.id)
                direct.append((event.details["latency_s"], event.step - before))
                value = not value
            with Connection(server.path, control=True) as conn:  # the socket, as gputui ctl does
                conn.welcome()
                for _ in range(max(5, count // 4)):
                    time.sleep(rng.uniform(0, 1.5 * step_s[0]))
                    t0 = time.perf_counter()
                    ident = conn.request("set_auto_recover", value)
                    while (ack := conn.read()) is not None and not (ack["kind"] == "ack" and ack.get("id") == ident):
                        pass
                    if ack is None or wait_for_answer(conn, ack["request_id"], 30) is None:
                        raise TimeoutError("no answer through the socket")
                    socket_s.append(time.perf_counter() - t0)
                    value = not value
        except BaseException as exc:
            failure.append(exc)
        finally:
            hub.controls.request("stop")

    thread = threading.Thread(target=requester, daemon=True)
    thread.start()
    try:
        gputui.fit(w.model, _cycle(w.batches), w.step, w.optimizer(), device=device, max_steps=10**9)
    finally:
        thread.join(10)
        server.close()
        hubs.install(None)
    if failure:
        raise failure[0]
    return {
        "description": w.description,
        "step_ms": 1e3 * step_s[0],
        "requests": len(direct),
        "latency_ms": harness.summary([1e3 * d[0] for d in direct]),
        "steps": harness.summary([d[1] for d in direct]),
        "steps_counts": {str(k): sum(1 for d in direct if d[1] == k) for k in sorted({d[1] for d in direct})},
        "socket_requests": len(socket_s),
        "socket_ms": harness.summary([1e3 * s for s in socket_s]),
    }


def _cycle(batches: list[Any]):
    while True:
        yield from batches


def run(quick: bool, device: str) -> dict[str, Any]:
    device = harness.device_of(device)
    out: dict[str, Any] = {"device": device, "workloads": {}}
    with harness.scratch() as tmp:
        for model, count in (QUICK if quick else FULL).items():
            out["workloads"][model] = measure(model, count, device, tmp)
            print(f"latency {model}: {out['workloads'][model]['latency_ms']['median']:.1f} ms median", file=sys.stderr)
    return out


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"Device {r['device']}. Milliseconds: median (min-max); steps: how many steps completed between "
        "the request and its application (1 = at the next step boundary).",
        "",
        "| workload | step (ms) | API requests | request to applied (ms) | max (ms) | steps (count) "
        "| socket round trip, `gputui ctl` path (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in r["workloads"].values():
        steps = ", ".join(f"{k}: {v}" for k, v in w["steps_counts"].items())
        lines.append(
            f"| {w['description']} | {harness.fmt(w['step_ms'])} | {w['requests']} | "
            f"{harness.spread(w['latency_ms'])} | {harness.fmt(w['latency_ms']['max'])} | {steps} | "
            f"{harness.spread(w['socket_ms'])} (n={w['socket_requests']}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    harness.main(run, __doc__)
