"""Hostile text in a run's records (issue 40, section 5): a node name that matplotlib would
parse as mathtext, and escape codes that a terminal would obey.

A node name comes from ``STEADYTRAIN_NODE`` or the host name and is written into every rank
file; anyone who can set either, or write the run directory, chooses it. The report must
finish (a plot that still cannot be drawn is named, the rest of the report is written), and
no control character from a record reaches a terminal or the page: the text report, the
HTML, the live alert lines and the console show it as a visible escape.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from steadytrain.monitor import straggler_live
from steadytrain.monitor.alerts import AlertConfig
from steadytrain.monitor.sinks import ConsoleSink, offscreen_console
from steadytrain.printable import html_text, printable
from steadytrain.report.plots import PLOT_NAMES
from steadytrain.run_support import say
from steadytrain.testing import forkserver

sys.path.insert(0, str(Path(__file__).parent))  # the builders of the concrete cases
import test_straggler  # noqa: E402
from test_hostile_records import _rank_records, _valid_ledger, _write  # noqa: E402

CLI = Path(sys.executable).parent / "steadytrain"
MATHTEXT = "gpu-$\\foo$-7"  # matplotlib's mathtext: "Unknown symbol: \foo" failed every plot
# CSI colour, an OSC that retitles the terminal (BEL-terminated), a carriage return that
# overprints the line, a bidi override that shows what follows reversed, a newline, a C1 CSI
HOSTILE = "n\x1b[31mRED\x1b]0;pwned\x07\rX\u202eevil\nline\x9b2J"
SHOWN = "n\\x1b[31mRED\\x1b]0;pwned\\x07\\x0dX\\u202eevil\\x0aline\\x9b2J"
# What must never reach a terminal raw: C0 (a newline between lines excepted), DEL, C1,
# the bidi controls and the line separators (steadytrain/printable.py).
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _run_with_node(run: Path, node: str) -> Path:
    """The two-rank run of test_hostile_records, rank 1 on the node ``node``."""
    _write(run / "ledger.jsonl", _valid_ledger())
    for rank in (0, 1):
        recs = _rank_records(rank)
        if rank == 1:
            recs[0]["node"] = node
        _write(run / "ranks" / f"rank-{rank:05d}.jsonl", recs)
    return run


def _report(run: Path, *args: str) -> subprocess.CompletedProcess:
    return forkserver.run([str(CLI), "report", str(run), *args], timeout=240)


def test_printable_shows_every_control_character_and_keeps_text() -> None:
    assert printable(HOSTILE) == SHOWN
    assert printable("\x00\x7f\t\u2028\u2066\u061c") == "\\x00\\x7f\\x09\\u2028\\u2066\\u061c"
    ordinary = "nœud-ü 节点 $\\alpha$ <b>&amp; ~!@#%^*()[]{}|;:'\",./?"
    assert printable(ordinary) == ordinary  # letters of any script, markup, symbols: kept
    assert printable(7) == "7" and printable(None) == "None"
    assert html_text("<b>\x1b[1m") == "&lt;b&gt;\\x1b[1m"


def test_report_draws_a_mathtext_node_name_as_text(tmp_path: Path) -> None:
    """``$\\foo$`` in a node name made ``steadytrain report`` exit 1 with no HTML."""
    run = _run_with_node(tmp_path / "run", MATHTEXT)
    p = _report(run, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["plots_missing"] == {}
    assert set(s["plots"]) == {"throughput", "waits", "goodput", "ranks", "timeline"}
    assert all(Path(f).stat().st_size > 0 for f in s["plots"].values())
    assert f"rank 1 ({MATHTEXT})" in s["plotted"]["ranks"]["rows"]  # drawn as written
    assert MATHTEXT in Path(s["html"]).read_text(encoding="utf-8")


def test_a_plot_that_cannot_be_drawn_is_named_and_the_report_is_written(tmp_path: Path) -> None:
    """One picture lost (here: a directory holds waits.png's name, so it cannot be saved)
    loses that picture, named with why, never the report."""
    run = _run_with_node(tmp_path / "run", "node-1")
    (run / "report" / "waits.png").mkdir(parents=True)
    p = _report(run, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert list(s["plots_missing"]) == ["waits"]
    assert "IsADirectoryError" in s["plots_missing"]["waits"]
    assert set(s["plots"]) == {"throughput", "goodput", "ranks", "timeline"}
    assert "waits.png not drawn" in p.stderr  # the warning
    page = Path(s["html"]).read_text(encoding="utf-8")
    assert "waits.png not drawn: IsADirectoryError" in page
    assert page.count("data:image/png;base64,") == 4
    text = _report(run)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "plot not drawn: waits.png (IsADirectoryError" in text.stdout


def test_no_plots_draws_none_and_says_so_with_the_same_numbers(tmp_path: Path) -> None:
    """``--no-plots``: no PNG, each named as not asked for on the page and in the JSON; the
    numbers are those of the report with its plots."""
    run = _run_with_node(tmp_path / "run", "node-1")
    p = _report(run, "--json", "--no-plots")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["plots"] == {} and not list((run / "report").glob("*.png"))
    assert s["plots_missing"] == dict.fromkeys(PLOT_NAMES, "not asked for (--no-plots)")
    page = Path(s["html"]).read_text(encoding="utf-8")
    assert "data:image/png" not in page and "timeline.png not drawn: not asked for" in page
    full = json.loads(_report(run, "--json").stdout)
    assert set(full["plots"]) == set(PLOT_NAMES)
    drop = ("plots", "plots_missing", "plotted")
    assert {k: v for k, v in s.items() if k not in drop} == {
        k: v for k, v in full.items() if k not in drop
    }


def test_no_control_character_from_the_records_reaches_the_terminal_or_the_page(
    tmp_path: Path,
) -> None:
    run = _run_with_node(tmp_path / "run", HOSTILE)
    # and a rank file that links out of the run directory, to a name of the same kind: the
    # warning that skips it names where it leads
    outside = tmp_path / f"elsewhere-{HOSTILE.replace(chr(10), '')}.jsonl"
    (run / "ranks" / "rank-00000.jsonl").rename(outside)
    (run / "ranks" / "rank-00000.jsonl").symlink_to(outside)
    p = _report(run)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not RAW.findall(p.stdout), sorted(set(RAW.findall(p.stdout)))
    assert not RAW.findall(p.stderr), sorted(set(RAW.findall(p.stderr)))
    assert f"rank 1    {SHOWN}" in p.stdout  # the rank line shows it, escaped
    assert printable(str(outside)) in p.stderr  # the skipped file, named
    page = (run / "report" / "report.html").read_text(encoding="utf-8")
    assert not RAW.findall(page.replace("\n", "")), sorted(set(RAW.findall(page)))
    assert html_text(HOSTILE) in page
    j = _report(run, "--json")
    assert j.returncode == 0 and not RAW.findall(j.stdout)
    assert json.loads(j.stdout)["plots_missing"] == {}  # the plots drew it too


def test_a_live_alert_naming_a_hostile_node_prints_it_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The live straggler check names the straggler's node, read from its rank file."""
    monkeypatch.setitem(test_straggler.NODES, 3, HOSTILE)
    check = straggler_live.StragglerCheck(tmp_path, AlertConfig())
    check.check()
    test_straggler._write(tmp_path, test_straggler._slow_storage({3}))
    with caplog.at_level(logging.WARNING, logger="steadytrain"):
        [alert] = check.check()
    assert alert["node"] == HOSTILE  # the record keeps what the rank wrote
    [line] = [r.getMessage() for r in caplog.records if "steadytrain alert" in r.getMessage()]
    assert not RAW.findall(line), line
    assert SHOWN in line


def test_the_console_shows_an_alert_as_text_not_markup_or_escapes() -> None:
    console = offscreen_console(width=200)
    sink = ConsoleSink(console=console)
    live: dict[str, Any] = {"step": 3, "last_alert": "straggler: [blink]x[/blink] \x1b]0;pwned\x07"}
    sink.write([], live)
    sink.close()
    out = console.file.getvalue()
    assert "[blink]x[/blink]" in out  # brackets shown, not taken as rich markup
    assert "\\x1b]0;pwned\\x07" in out and "\x1b]0;pwned" not in out


def test_console_lines_show_control_characters_escaped(capsys: pytest.CaptureFixture) -> None:
    say(f"resumed on node {HOSTILE}")
    err = capsys.readouterr().err
    assert err == f"[steadytrain] resumed on node {SHOWN}\n"
