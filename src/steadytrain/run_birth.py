"""When this process was born: where ``steadytrain.Run`` starts a job's start-up clock.

Its own module, importing nothing heavy, so a training script (and a test's child process)
can import it before torch; ``train/birth.py`` re-exports it for older imports."""

from __future__ import annotations

import os
import time

__all__ = ["process_start"]


def process_start() -> float:
    """When this process was born, as a wall-clock time: start-up cost counts from there
    (interpreter start and imports included).

    ``/proc/self/stat`` gives the birth in clock ticks since boot (``starttime``, 10 ms at the
    usual 100 Hz); ``CLOCK_BOOTTIME`` gives the time since boot now, with nanosecond
    resolution and on the same base, so ``now - (boottime - starttime)`` is the birth with
    one tick of uncertainty (the middle of that tick is returned: within +-5 ms). psutil's
    ``create_time`` adds ``starttime`` to the boot time of ``/proc/stat``, which has whole
    seconds: up to a second early, so a restarted process seemed to begin before the one it
    replaced was killed and the failure's detection was booked as start-up (issue 13).
    Without ``/proc`` (not Linux): the first call's time, which misses the imports before it.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22; the command name (field 2, in parentheses) may hold spaces and ")".
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])
        hz = os.sysconf("SC_CLK_TCK")
        wall, boot = time.time(), time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return wall - (boot - (ticks + 0.5) / hz)
