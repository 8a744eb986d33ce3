"""Whether a process of this host is alive, from its pid: the one check behind the output-dir lock's
stale-holder report (run_lock.py) and the clean-up of killed prepares' temp folders (data/corpus.py).

May import: the standard library only.
"""
from __future__ import annotations

import os


def pid_alive(pid) -> bool:
    """True when a process with this pid exists on this host (another user's counts as alive). A pid read
    from a file may be anything: a non-integer or a pid <= 0 is no process (os.kill would signal a whole
    process group for 0 or -N, and every process for -1)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: existence and permission check only, nothing is sent
    except (ProcessLookupError, OverflowError):  # OverflowError: a number past any pid (a C long)
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True
