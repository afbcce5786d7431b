"""`python tests/fork_relay.py ARGS` behaves as `python -m pdserve ARGS` for a shell script, and costs what a fork does.

It asks the fork server named in its environment (the run's, tests/fork_servers.py) for `python -m pdserve ARGS`
with its own environment, directory, stdout and stderr, then stands in for that child: the signals a shell sends it
(`kill %1`) go on to the child, and it exits as the child did (a signal's death included), so the script sees what
a spawned process would show. Where there is no server, or it refuses, the relay becomes `python -m pdserve ARGS`
itself (exec), as the launcher spawns, and says so on stderr. tests/test_readme.py runs the README's blocks through it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pdserve.forkserver import ENV_VAR, ForkedChild, fork

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SPAWNED = "fork_relay: python -m pdserve is spawned, not forked"  # on stderr, for the test to report
POLL_S = 0.2


def main(args: list[str]) -> int:
    argv = [sys.executable, "-m", "pdserve", *args]
    server = os.environ.get(ENV_VAR)
    child = fork(server, argv, dict(os.environ), sys.stderr.fileno(), stdout=sys.stdout.fileno()) if server else None
    if not isinstance(child, ForkedChild):
        print(f"{SPAWNED}: {child or 'no fork server'}", file=sys.stderr, flush=True)
        os.execv(sys.executable, argv)
    # A handler only notes the signal: the child's lock may be held by the wait the signal interrupted.
    pending: list[int] = []
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _frame: pending.append(received))
    while True:
        while pending:
            child.send_signal(pending.pop(0))
        try:
            code = child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            continue
        break
    if code < 0:  # die of the same signal, so the shell reports what it would for the child
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
