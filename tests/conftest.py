"""The whole suite's scheduling: what a test needs decides where and when it runs.

``./run.sh test`` runs the suite on parallel workers (pytest-xdist; docs/testing.md,
"Running the suite"). Most of the suite waits on processes and sockets, so workers overlap
well even on 2 cores; what they must not do is share what one test owns. Every test falls
into place by its folder, its marks and its fixtures, so a new test needs nothing more:

- **folder marks**: a test under ``tests/nodes`` is ``nodes``, ``tests/e2e`` is ``e2e``,
  ``tests/packaging`` is ``packaging``, ``tests/s3`` is ``s3``, ``tests/distributed`` is
  ``dist``. The inner loop (``./run.sh quick``) leaves out ``nodes``, ``e2e`` and
  ``packaging``; a test elsewhere that is one of those says so with ``pytestmark``.
- **units of scheduling**: every ``nodes`` or ``machine`` test is in one unit,
  ``MACHINE_GROUP``, run by one worker one test after another: the node harness takes the
  machine's namespaces, its /dev/shm and both cores, its replays time what they inject, and
  a ``machine`` test times a deadline or compares ranks' speeds, so none of them may run
  beside another. A test that uses a module-scoped fixture runs with the rest of its module
  (the fixture is paid once, not once per worker). Every other test is a unit of its own.
- **order**: the longest units first (the machine group, then the fresh venv and the
  torchrun runs), so no worker is left alone with a long one at the end.

xdist's own ``--dist loadgroup`` cannot carry the units here (it renames node ids, which
pytest 9 no longer allows), so each worker writes its units to a file the controller names
(``pytest_configure_node``) and the scheduler below reads it once every worker collected.

A session fixture runs once per worker; ``shared_dir`` builds a read-only input once per
run for every worker (the e2e baseline run).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent

# Folder -> the mark every test in it carries.
FOLDER_MARKS = {
    "nodes": "nodes",
    "e2e": "e2e",
    "packaging": "packaging",
    "s3": "s3",
    "distributed": "dist",
}
# Marks whose tests share the one unit that never runs two of them at once.
MACHINE_MARKS = ("nodes", "machine")
MACHINE_GROUP = "machine"
# Rough seconds a test of each kind takes, for the order only (the first mark found counts).
WEIGHTS = {"packaging": 40.0, "e2e": 40.0, "dist": 15.0, "s3": 3.0}
WEIGHT_DEFAULT = 1.0
LOAD_MODES = ("load", "loadscope", "loadfile", "loadgroup", "worksteal")
UNITS_FILE = "steadytrain_units_file"  # the workerinput key: where a worker writes its units
FROM_TESTPATHS = "steadytrain_from_testpaths"  # the workerinput key: see _from_testpaths
_UNITS_PATH = pytest.StashKey[Path]()
# What this session collected from ``testpaths`` before any deselection: test files that gave
# tests, and modules that skipped themselves (``session_collection``).
_COLLECTED = pytest.StashKey[set[str]]()
_SKIPPED: set[str] = set()  # one session per process (an xdist worker is a process)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "machine: timing-sensitive (a deadline, ranks' speeds compared); runs in the machine "
        "group with the node harness, never beside another such test",
    )


def _folder(item: pytest.Item) -> str:
    try:
        rel = Path(str(item.path)).resolve().relative_to(TESTS)
    except ValueError:
        return ""
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _module_scoped(item: pytest.Item) -> bool:
    """Whether the test uses a fixture set up once per module (or class, or package)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        defs and defs[-1].scope in ("module", "class", "package")
        for defs in info.name2fixturedefs.values()
    )


def unit_of(item: pytest.Item) -> str:
    """The unit of scheduling ``item`` belongs to: a group's name, or its own node id."""
    if any(item.get_closest_marker(m) for m in MACHINE_MARKS):
        return MACHINE_GROUP
    if _module_scoped(item):
        return item.nodeid.split("::", 1)[0]  # its module
    return item.nodeid


def _weight(item: pytest.Item) -> float:
    for mark, w in WEIGHTS.items():
        if item.get_closest_marker(mark):
            return w
    return WEIGHT_DEFAULT


def _from_testpaths(config: pytest.Config) -> bool:
    """Whether this session collected what the test command collects: ``testpaths``, no
    paths given and nothing ignored on the command line. An xdist worker is given the
    controller's arguments as paths, so the controller says it (``pytest_configure_node``)."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None:
        return bool(workerinput.get(FROM_TESTPATHS, False))
    ignored = config.getoption("ignore", None) or config.getoption("ignore_glob", None)
    narrowed = config.getoption("lf", False)  # --last-failed skips whole files
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not (ignored or narrowed)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and report.nodeid.endswith(".py"):  # a module that skipped itself
        _SKIPPED.add(report.nodeid)


@pytest.fixture(scope="session")
def session_collection(request: pytest.FixtureRequest) -> tuple[set[str], set[str]] | None:
    """``(files that gave tests, modules that skipped themselves)`` as this session collected
    them from ``testpaths`` before ``-m``/``-k`` deselected anything; None when the session
    was given paths (then it saw only part of the suite)."""
    config = request.config
    if not _from_testpaths(config) or _COLLECTED not in config.stash:
        return None
    return set(config.stash[_COLLECTED]), set(_SKIPPED)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[_COLLECTED] = {item.nodeid.split("::", 1)[0] for item in items}
    for item in items:
        mark = FOLDER_MARKS.get(_folder(item))
        if mark and not item.get_closest_marker(mark):
            item.add_marker(mark)
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    if UNITS_FILE not in workerinput:
        return  # not a worker of our scheduler: the files' order, no units
    units = {item.nodeid: unit_of(item) for item in items}
    totals: dict[str, float] = {}
    for item in items:
        totals[units[item.nodeid]] = totals.get(units[item.nodeid], 0.0) + _weight(item)
    totals[MACHINE_GROUP] = float("inf")
    # Longest first; a stable sort keeps the files' order within a weight, so every worker
    # sends the same list (xdist checks that).
    items.sort(key=lambda it: -totals[units[it.nodeid]])
    path = Path(workerinput[UNITS_FILE])
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: v for k, v in units.items() if k != v}))
    os.replace(tmp, path)  # every worker writes the same units; the last rename wins


@pytest.hookimpl(optionalhook=True)  # a venv without pytest-xdist still loads this file
def pytest_configure_node(node: Any) -> None:
    """Controller, per worker: where that worker writes its units (one file per run)."""
    stash = node.config.stash
    if _UNITS_PATH not in stash:
        stash[_UNITS_PATH] = Path(tempfile.mkdtemp(prefix="steadytrain-units-")) / "units.json"
    node.workerinput[UNITS_FILE] = str(stash[_UNITS_PATH])
    node.workerinput[FROM_TESTPATHS] = _from_testpaths(node.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _UNITS_PATH in config.stash:
        shutil.rmtree(config.stash[_UNITS_PATH].parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Load balancing over the units above, in the workers' order (every load-balancing
    ``--dist`` mode; ``-n N`` alone means ``load``, which would split the node group)."""
    if config.getvalue("dist") not in LOAD_MODES:
        return None  # `--dist each`: every worker runs everything
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] = {}

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed:
                path = config.stash[_UNITS_PATH]
                # No file: the workers' collection failed before writing it; xdist then
                # reports their errors, which a crash here would hide.
                self.units = json.loads(path.read_text()) if path.exists() else {}
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return self.units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # keep the workers' longest-first order
    return UnitScheduling(config, log)


# -- inputs built once per run, shared by every worker ------------------------------------


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``shared_dir(name, build)``: a directory that ``build(path)`` fills once per test
    run, for every worker of that run (under a file lock; the other workers wait, then reuse
    it). Only for inputs that tests read: a test that writes takes its own copy. Without
    workers it is this session's own. It stays in the run's base directory, which pytest
    removes when the run passes."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's base directory, above every worker's
    root = base / "shared"
    root.mkdir(exist_ok=True)

    def get(name: str, build: Callable[[Path], None]) -> Path:
        path, done = root / name, root / f"{name}.done"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)  # a build that failed half-way
                path.mkdir()
                build(path)
                done.touch()
        return path

    return get
