"""Diagnosis: a pure function from a run directory's records to incidents.

record (monitor/) -> diagnose (here) -> report (report/). Nothing here writes a
file or reads the clock: ``diagnose(run_dir)`` reads what the live wing recorded (ledger,
rank files, hang verdicts) and returns ``Incident`` objects; ``report``, ``report --json``,
the HTML, the live alerts (as far as they can see) and ``demo --incident`` all print them.
"""

from steadytrain.diagnose.incident import KINDS, Incident

__all__ = ["KINDS", "Incident"]
