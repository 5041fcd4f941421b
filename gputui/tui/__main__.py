"""`python -m gputui.tui FD PID SCRIPT REFRESH`: the screen that `gputui run` starts (local.py, runner.py).

Before anything is imported: a Ctrl-C typed while the terminal is not raw yet reaches the whole
process group, and the run (which stops after its step) is the one to take it; and on Linux the
screen is sent SIGTERM (it leaves, giving the terminal back) if the run dies, rather than stay
behind on a terminal whose keys now go to the shell.
"""

import signal
import sys

signal.signal(signal.SIGINT, signal.SIG_IGN)  # started with it blocked (local.py): a pending one is dropped
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
if sys.platform == "linux":
    import ctypes
    import os

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(sys.argv[2]):  # the run died before the request was made
        sys.exit(1)

from .runner import screen_main  # noqa: E402

sys.exit(screen_main(sys.argv[1:]))
