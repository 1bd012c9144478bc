#!/usr/bin/env bash
# Run the test suite against a torch release other than the locked one (by default the
# newest on the package index), in its own virtual environment, and write the result to a file.
#
#   scripts/test-newest-torch.sh [PYTEST ARGS]
#
# Why a separate script, not part of ./run.sh test: the newest torch's wheel is large (the
# package index serves a CUDA build of several GB unless TORCH_INDEX_URL points at a CPU wheel
# index), so this is a manual step before widening the torch range in pyproject.toml.
#
# What it does:
#   1. a venv at $VENV (default .venv-torch-newest, gitignored), reused across runs;
#   2. torch from $TORCH_SPEC (default "torch": the newest release), from $TORCH_INDEX_URL
#      when set (e.g. PyTorch's own CPU wheel index: a smaller download);
#   3. every other package at its locked version (constraints.txt without its torch line),
#      then steadytrain itself with --no-deps: pyproject.toml's torch range would otherwise
#      make pip replace the torch under test with an older one;
#   4. pytest (default: the whole suite except the `packaging` tests, which build their own
#      venv from the lock and so never see this torch), junit XML and a JSON summary in
#      $RESULT_DIR (default build/newest-torch/).
#
# Environment: TORCH_SPEC, TORCH_INDEX_URL, VENV, RESULT_DIR, PYTHON (default python3).
# Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-torch-newest}"
RESULT_DIR="${RESULT_DIR:-build/newest-torch}"
TORCH_SPEC="${TORCH_SPEC:-torch}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULT_DIR"
log="$RESULT_DIR/setup.log"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
: >"$log"
step() {  # one set-up command, its output to $log; stop on the first failure
  "$@" >>"$log" 2>&1 || {
    echo "[newest-torch] set-up failed: $*; see $log" >&2
    tail -20 "$log" >&2
    exit 3
  }
}
pip=("$VENV/bin/python" -m pip)
echo "[newest-torch] installing $TORCH_SPEC into $VENV (log: $log)" >&2
step "${pip[@]}" install -q --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  step "${pip[@]}" install -q --upgrade --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
  step "${pip[@]}" install -q --upgrade "$TORCH_SPEC"
fi
# The lock minus torch: the other packages stay exactly as CI tests them, so a failure
# here is torch's, not a numpy or pytest upgrade's. The lock is a complete freeze, so it is
# installed as is (--no-deps: no resolver run, which could backtrack for minutes over a
# package the lock pins); the torch just installed is a constraint too (its distribution
# version: torch.__version__ may carry a local label such as +cpu that the distribution
# does not), so nothing below may move it. `pip check` then lists, in the log, what the
# lock and this torch disagree on.
torch_dist=$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')
grep -v -i -E '^torch==' constraints.txt >"$RESULT_DIR/constraints-no-torch.txt"
echo "torch==$torch_dist" >>"$RESULT_DIR/constraints-no-torch.txt"
grep -E '^[A-Za-z0-9_.-]+==' constraints.txt | grep -v -i -E '^torch==' \
  >"$RESULT_DIR/requirements-locked.txt"
step "${pip[@]}" install -q --no-deps -c "$RESULT_DIR/constraints-no-torch.txt" \
  -r "$RESULT_DIR/requirements-locked.txt"
step "${pip[@]}" install -q --no-deps -e .
"${pip[@]}" check >>"$log" 2>&1 || echo "[newest-torch] pip check: see $log" >&2

torch_version=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
echo "[newest-torch] torch $torch_version; running pytest" >&2
if [ $# -eq 0 ]; then
  set -- -q -p no:cacheprovider -m "not packaging" tests
fi
set +e
"$VENV/bin/python" -m pytest --junitxml="$RESULT_DIR/junit.xml" "$@" 2>&1 | tee "$RESULT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$RESULT_DIR/pytest.log" | tail -1 | sed -E 's/=+//g; s/^ +| +$//g')
"$VENV/bin/python" - "$RESULT_DIR/result.json" "$rc" "$summary" "$*" <<'EOF'
import datetime, json, platform, sys
import numpy, torch
out, rc, summary, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
result = {
    "torch": torch.__version__,
    "torch_cuda_build": torch.version.cuda,
    "numpy": numpy.__version__,
    "python": platform.python_version(),
    "date": datetime.date.today().isoformat(),
    "command": "scripts/test-newest-torch.sh " + args,
    "pytest_exit_status": rc,
    "summary": summary,
}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
print(json.dumps(result))
EOF
exit "$rc"
