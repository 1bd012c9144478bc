"""Text from records, shown to a person: control characters made visible, never obeyed.

A node name, a frame, a reason or a path in a run's records is untrusted input (DESIGN,
"Records are input too"): ``STEADYTRAIN_NODE`` or a rank file may hold ``ESC[31m``, an OSC
sequence that sets the terminal's title or writes its clipboard, a carriage return that
overprints the line before it, or a bidi override that shows a name reversed. ``printable``
is the one place such text is neutralised before it reaches a terminal (the text report,
live alerts, console lines), a page (``html_text``) or a plot: every C0 and C1 control
character, DEL, the Unicode bidi controls and the line and paragraph separators become a
visible escape (``\\x1b``, ``\\u202e``). Tabs and newlines are escaped too: a record's
string is one line, and a newline in a node name would print a line the report never
wrote. Ordinary text, any script's letters included, passes unchanged.

Only the standard library: any module may call it.
"""

from __future__ import annotations

import html
import re
from typing import Any

__all__ = ["printable", "html_text"]

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: Any) -> str:
    """``str(text)`` with every control character written as its escape (module docstring)."""
    return _CONTROL.sub(_escape, str(text))


def html_text(text: Any) -> str:
    """``printable(text)`` escaped for HTML (``<``, ``&``, quotes): a record's text on a page."""
    return html.escape(printable(text))
