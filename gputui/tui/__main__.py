"""`python -m gputui.tui FD PID SCRIPT REFRESH`: the screen that `gputui run` starts (runner.py)."""

import sys

from .runner import screen_main

sys.exit(screen_main(sys.argv[1:]))
