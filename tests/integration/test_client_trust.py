"""`gputui jobs / attach --json / ctl` against folders and servers they must not trust, and fake
servers that misbehave: each ends in one line on stderr and exit 1, never a traceback, and
nothing from the socket reaches the terminal with its control characters."""

import concurrent.futures
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from process import gputui
from samples import step_sample

from gputui.telemetry.protocol import VERSION
from gputui.telemetry.sample import Memory, StepRecord, StepSample

NOBODY = 65534
HELLO = {
    "v": VERSION,
    "kind": "hello",
    "pid": 1,
    "argv": ["fake.py"],
    "server_started": 0.0,
    "runs": 1,
    "info": {"device": "cpu", "argv": ["fake.py"]},
    "summary": None,
    "controllable": True,
}


def steps(memory=None, **fields):
    """A steps record of one row (StepSample's fields in order), the `fields` named replaced."""
    row = StepRecord.of(step_sample(3, t=1.0, loss=0.5, memory=Memory("cpu", allocated=1))).row()
    names = [f.name for f in dataclasses.fields(StepSample)]
    for name, value in fields.items():
        row[names.index(name)] = value
    if memory is not None:
        row[names.index("memory")] = memory
    return {"v": VERSION, "kind": "steps", "rows": [row]}


STEP = steps()


def line(record):
    return json.dumps(record).encode() + b"\n"


WELCOME = line(HELLO) + line({"v": VERSION, "kind": "live"})


class FakeServer:
    """A plain Unix socket server: each connection gets `reply` (bytes, or a function of the socket)."""

    def __init__(self, path, reply):
        self.path, self.reply, self.received = path, reply, []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.listener.settimeout(0.2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn):
        conn.settimeout(10)
        with conn:
            try:
                if callable(self.reply):
                    self.reply(conn)
                else:
                    conn.sendall(self.reply)
                    conn.shutdown(socket.SHUT_WR)
                while data := conn.recv(65536):
                    self.received.append(data)
            except OSError:
                pass

    def close(self):
        self.stopped.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def env(tmp_path):
    """No XDG_RUNTIME_DIR: the socket folder is $TMPDIR/gputui-<uid>, where anyone may plant one."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    return {**env, "TMPDIR": str(tmp)}


@pytest.fixture
def folder(env):
    return os.path.join(env["TMPDIR"], f"gputui-{os.getuid()}")


@pytest.fixture
def fake(request):
    servers = []

    def start(path, reply=WELCOME):
        server = FakeServer(str(path), reply)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def assert_one_line_error(done, *words):
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gputui: error: "), done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def assert_every_command_refuses(env, server, *words):
    pid = os.getpid()  # the planted socket's name: a live process, as find_jobs wants
    for args in (["jobs"], ["jobs", "--json"], ["attach", pid, "--json"], ["ctl", pid, "stop"]):
        done = gputui(*args, env=env)
        assert_one_line_error(done, *words)
        assert str(HELLO["argv"][0]) not in done.stdout, "the planted job must not be listed"
    assert not any(b'"control"' in data for data in server.received), "no control may reach a planted server"


@pytest.mark.skipif(os.getuid() != 0, reason="planting another user's folder needs root to chown it")
def test_a_folder_planted_by_another_user_is_refused(env, folder, fake):
    os.mkdir(folder, 0o700)
    server = fake(os.path.join(folder, f"{os.getpid()}.sock"))
    os.chown(server.path, NOBODY, NOBODY)
    os.chown(folder, NOBODY, NOBODY)
    assert_every_command_refuses(env, server, folder, f"belongs to another user (uid {NOBODY})", "remove it")


def test_a_folder_open_to_others_is_refused(env, folder, fake):
    os.mkdir(folder)
    os.chmod(folder, 0o755)
    server = fake(os.path.join(folder, f"{os.getpid()}.sock"))
    assert_every_command_refuses(env, server, folder, "open to other users (mode 755)", "chmod 700")


def test_a_folder_that_is_a_symlink_is_refused(env, folder, fake, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    os.symlink(real, folder)
    server = fake(real / f"{os.getpid()}.sock")
    assert_every_command_refuses(env, server, folder, "symbolic link")


def test_a_missing_folder_means_no_jobs_and_is_not_created(env, folder):
    done = gputui("jobs", env=env)
    assert done.returncode == 0 and done.stdout.startswith("no running gputui jobs")
    assert not os.path.exists(folder)


def test_an_explicit_socket_path_is_checked_too(env, fake, tmp_path):
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o755)
    server = fake(open_folder / "123.sock")
    assert_one_line_error(gputui("attach", server.path, "--json", env=env), "open to other users")
    script = open_folder / "train.py"  # a typo'd job name in an ordinary folder: said as such, not its mode
    script.write_text("")
    assert_one_line_error(gputui("attach", str(script), "--json", env=env), "train.py is not a socket")
    assert_one_line_error(gputui("ctl", str(open_folder / "abc"), "pause", env=env), "no such job or socket")
    if os.getuid() == 0:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        server = fake(private / "456.sock")
        os.chown(server.path, NOBODY, NOBODY)
        assert_one_line_error(
            gputui("attach", server.path, "--json", env=env), f"belongs to another user (uid {NOBODY})"
        )


PEER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(os.path.join(sys.argv[1], f"{os.getpid()}.sock"))  # as root: a socket of ours, in our private folder
os.setuid(int(sys.argv[2]))  # but the server behind it runs as someone else
s.listen(8)
s.settimeout(30)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    try:
        c.sendall(sys.argv[3].encode())
    except OSError:  # the client refused us first
        pass
    c.close()
"""


@pytest.mark.skipif(
    os.getuid() != 0 or not hasattr(socket, "SO_PEERCRED"),
    reason="a server of another uid needs root (setuid) and SO_PEERCRED (Linux)",
)
def test_a_server_running_as_another_user_is_refused(env, folder, processes):
    os.mkdir(folder, 0o700)
    peer = processes.start(
        [sys.executable, "-c", PEER, folder, NOBODY, WELCOME.decode()], stdout=subprocess.PIPE, text=True
    )
    assert peer.stdout.readline().strip() == "ready"
    for args in (["attach", peer.pid, "--json"], ["ctl", peer.pid, "pause"], ["jobs"]):
        assert_one_line_error(gputui(*args, env=env), f"runs as another user (uid {NOBODY})", "not trusted")


ESCAPES = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


def wrong(**fields):
    return line({**HELLO, **fields}) + line({"v": VERSION, "kind": "live"})


MISBEHAVING = {
    "closes at once": b"",
    "closes mid-welcome": line(HELLO),
    "cuts a line": line(HELLO)[:20],
    "garbage": b"\x00\xff garbage\n" * 3,
    "nested": b"[" * 5000 + b"\n",
    "not an object": b"[1, 2, 3]\n",
    "step is a string": line(HELLO) + line(steps(step="x")) + line({"v": VERSION, "kind": "live"}),
    "argv is a dict": wrong(argv={"a": 1}, info={"argv": {"x": [1]}}),
    "info is a list": wrong(info=[1, 2]),
    "argv holds a dict": wrong(info={"argv": ["x" * 100_000, {"k": "v"}]}),
    "device is a dict": wrong(info={"device": {"a": 1}}),
    "min_micro_batch is text": wrong(info={"min_micro_batch": "2"}),  # the TUI compares it to a micro-batch
    "summary error is a list": wrong(summary={"error": ["boom"]}),
    "server_started is text": wrong(server_started="yesterday"),
    "history of strings": line(HELLO)
    + line({"v": VERSION, "kind": "history", "series": {"loss": {"steps": ["a"], "values": [], "stride": 1}}}),
    # Numbers JSON allows and Python cannot format or convert: int(inf), float(10**400)
    "server_started is Infinity": wrong(server_started=float("inf")),
    "server_started is NaN": wrong(server_started=float("nan")),
    "event time of 400 digits": line(HELLO)
    + line({"v": VERSION, "kind": "event", "t": 10**400, "step": 1, "name": "paused"})
    + line({"v": VERSION, "kind": "live"}),
    "freed bytes of 400 digits": line(HELLO)
    + line(
        {
            "v": VERSION,
            "kind": "event",
            "t": 1.0,
            "step": 1,
            "name": "cache_freed",
            "bytes": 10**400,
            "reserved_before": 1,
            "reserved_after": 0,
        }
    )
    + line({"v": VERSION, "kind": "live"}),
    "allocated of 400 digits": line(HELLO)
    + line(steps(memory=["cpu", 10**400, *[None] * 15]))
    + line({"v": VERSION, "kind": "live"}),
}


@pytest.mark.parametrize("case", MISBEHAVING)
def test_misbehaving_servers_get_one_line_and_exit_1(env, folder, fake, case):
    os.mkdir(folder, 0o700)
    fake(os.path.join(folder, f"{os.getpid()}.sock"), MISBEHAVING[case])
    for args in (["attach", os.getpid(), "--json"], ["ctl", os.getpid(), "pause"], ["jobs"], ["jobs", "--json"]):
        done = gputui(*args, env=env)
        assert_one_line_error(done, str(os.getpid()))


def test_a_job_cannot_print_rows_of_its_own_or_reverse_text(env, folder, fake):
    os.mkdir(folder, 0o700)
    fake(
        os.path.join(folder, f"{os.getpid()}.sock"),
        wrong(info={"argv": ["x.py\n  31337  fake.py  cpu  training"], "device": "cpu\u202egnp.exe"}),
    )
    done = gputui("jobs", env=env)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2 and "\u202e" not in done.stdout, done.stdout


def test_huge_fields_are_listed_within_bounds(env, folder, fake):
    os.mkdir(folder, 0o700)
    fake(os.path.join(folder, f"{os.getpid()}.sock"), wrong(info={"argv": ["x" * 100_000], "device": "c" * 50_000}))
    done = gputui("jobs", env=env)
    assert done.returncode == 0, done.stderr
    assert max(map(len, done.stdout.splitlines())) < 300


def test_a_silent_server_times_out(env, folder, fake):
    os.mkdir(folder, 0o700)
    hold = threading.Event()
    fake(os.path.join(folder, f"{os.getpid()}.sock"), lambda conn: hold.wait(20))
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # each waits out the same timeout: together
            runs = list(
                pool.map(
                    lambda args: gputui(*args, env=env),
                    (["attach", os.getpid(), "--json"], ["ctl", os.getpid(), "pause"], ["jobs"]),
                )
            )
        for done in runs:
            assert_one_line_error(done, "did not say who it is")
    finally:
        hold.set()


def test_escape_sequences_from_a_job_never_reach_the_terminal(env, folder, fake):
    os.mkdir(folder, 0o700)
    hostile = {
        **HELLO,
        "argv": [f"evil{ESCAPES}.py"],
        "info": {"device": f"cpu{ESCAPES}", "argv": [f"x{ESCAPES}.py"], f"key{ESCAPES}": ESCAPES},
    }
    step = {**steps(amp=ESCAPES, loss_source=ESCAPES), f"k{ESCAPES}": [ESCAPES, {ESCAPES: ESCAPES}]}
    refusal = {"v": VERSION, "kind": "error", "id": 1, "reason": f"no{ESCAPES}"}
    fake(
        os.path.join(folder, f"{os.getpid()}.sock"),
        line(hostile) + line(step) + line({"v": VERSION, "kind": "live"}) + line(refusal),
    )
    for args in (["jobs"], ["jobs", "--json"], ["attach", os.getpid(), "--json"], ["ctl", os.getpid(), "pause"]):
        done = gputui(*args, env=env)
        assert "Traceback" not in done.stderr, done.stderr
        shown = done.stdout + done.stderr
        for char in "\x1b\x07\x9b":
            assert char not in shown, (args, shown)
        assert "\\u001b" not in shown and "\\u009b" not in shown, "not even escaped: stripped"
    listed = gputui("jobs", env=env).stdout
    assert "evil" not in listed and " x.py " in listed  # whole sequences go, not only their first byte
    refused = gputui("ctl", os.getpid(), "pause", env=env)
    assert_one_line_error(refused, "refused: no")
    assert refused.stderr.rstrip().endswith("refused: no"), refused.stderr


def test_a_full_backlog_is_waited_for_not_failed_at_once(env, folder):
    os.mkdir(folder, 0o700)
    path = os.path.join(folder, f"{os.getpid()}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    waiting = []
    while True:  # fill the backlog: the next connect would get EAGAIN
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        waiting.append(s)

    done_serving = threading.Event()

    def accept_later():
        time.sleep(1.0)
        listener.settimeout(0.1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not done_serving.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(line(HELLO) + line(STEP) + line({"v": VERSION, "kind": "live"}))

    thread = threading.Thread(target=accept_later, daemon=True)
    thread.start()
    try:
        done = gputui("attach", os.getpid(), "--json", env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["step"] == 3
    finally:
        done_serving.set()
        thread.join(20)
        listener.close()
        for s in waiting:
            s.close()
