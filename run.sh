#!/usr/bin/env bash
# steadytrain quick start. Two commands, each does its own set-up on a fresh machine:
#   ./run.sh demo [--json]      # tokenize the embedded corpus, train with crashes, report
#   ./run.sh test [PYTEST ARGS] # the whole test suite, on parallel workers
#   ./run.sh quick [PYTEST ARGS] # the inner loop: all but the node harness, torchrun and packaging
# Set-up: a virtual environment in .venv with every extra, at the exact versions of
# constraints.txt (pyproject.toml only declares ranges), reinstalled only when either changes.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${STEADYTRAIN_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.installed-$(cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "setting up $VENV (first run only; pinned CPU torch, ~2 min)..." >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -c constraints.txt -e '.[all,test]' >&2
  # torchtitan's declared deps clash with the s3 lock; its loader/checkpoint need none more
  "$VENV/bin/pip" install -q --no-deps -c constraints.txt torchtitan >&2
  rm -f "$VENV"/.installed-*
  touch "$stamp"
fi
# Parallel test workers (pytest-xdist; tests/conftest.py groups what must not run side by
# side). The suite mostly waits on processes and sockets, so more workers than cores pay:
# docs/testing.md has the measurements. `-n N` or `-p no:xdist` in the arguments wins.
workers=(-n "${STEADYTRAIN_TEST_WORKERS:-4}")
# Byte-code caches on for the tests, whatever the shell says: with PYTHONDONTWRITEBYTECODE set
# every worker re-ran pytest's assertion rewriting of every test module at each collection
# (~8 s of CPU per worker per run) and every fresh interpreter compiled steadytrain again.
# The caches go to __pycache__/ (git-ignored); docs/testing.md has the measurement.
unset PYTHONDONTWRITEBYTECODE
for a in "$@"; do
  case "$a" in -n|-n[0-9]*|--numprocesses*|no:xdist|-pno:xdist|--pdb) workers=() ;; esac
done
cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
  demo) exec "$VENV/bin/steadytrain" demo "$@" ;;
  test) scripts/ensure-slurm.sh || true  # slurm-wlm for tests/nodes/test_nodes_slurm.py; never fatal
        exec "$VENV/bin/python" -m pytest "${workers[@]}" "$@" ;;
  # The inner loop: everything but the node harness, the torchrun end-to-end runs and the
  # fresh-venv packaging test (docs/testing.md).
  quick) exec "$VENV/bin/python" -m pytest "${workers[@]}" -m "not nodes and not e2e and not packaging" "$@" ;;
  *) echo "usage: ./run.sh demo [--json] | ./run.sh test [pytest args] | ./run.sh quick [pytest args]" >&2; exit 64 ;;
esac
