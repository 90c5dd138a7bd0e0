#!/usr/bin/env bash
# Two entry points for newcomers and CI:
#   ./dev.sh demo   install into .venv, profile examples/gpt.py and print its layer table
#   ./dev.sh test   install into .venv (with test tools) and run the test suite with pytest
#                   (extra arguments go to pytest: -m 'not slow' for the fast inner loop)
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  local stamp="$VENV/.installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    # constraints.txt pins torch==2.13.0 and everything else the tests were run with
    echo "installing into $VENV (log: $VENV/install.log) ..." >&2
    # DeepSpeed builds against the torch already installed (--no-build-isolation), so it comes second
    if ! { "$VENV/bin/python" -m pip install -c constraints.txt -e '.[dev]' &&
           "$VENV/bin/python" -m pip install -c constraints.txt --no-build-isolation deepspeed; } >"$VENV/install.log" 2>&1; then
      tail -20 "$VENV/install.log" >&2
      echo "error: installing the project failed; the whole log is in $VENV/install.log" >&2
      exit 1
    fi
    touch "$stamp"
  fi
}

case "${1:-}" in
  demo)
    install
    shift
    "$VENV/bin/planner" profile examples/gpt.py "$@"
    ;;
  test)
    install
    shift
    # glibc hands large freed blocks back to the OS and page-faults them in again on the next step,
    # which makes CPU step times jump between two levels; the timing tests want steady steps
    export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1073741824} MALLOC_TRIM_THRESHOLD_=${MALLOC_TRIM_THRESHOLD_:-4294967296}
    # two worker processes, a test file each at a time: most of a torchrun test is one process waiting for
    # another, so a second file runs beside it (the suite takes 2/3 of the time); -n 0 runs in this process
    "$VENV/bin/python" -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  *)
    echo "usage: ./dev.sh demo | ./dev.sh test [pytest args]" >&2
    exit 2
    ;;
esac
