#!/usr/bin/env bash
# `make test`: the suite in two pytest processes side by side. The tests that start real
# SGLang servers (marker `sglang`) run one after another in one of them; everything else runs
# in the other. A server test keeps about one core busy, so the two streams fill a small
# machine, while two servers side by side would each run about 2x slower. The second stream's
# output is printed when both have finished; the exit status is non-zero if either failed
# (pytest's 5, "no test ran", included).
#
#   bash scripts/run_tests.sh [PYTEST ARGS]    # PY: the interpreter (default .venv/bin/python)
#   TEST_STREAMS=1 bash scripts/run_tests.sh   # one process, every test
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${TEST_STREAMS:-2}" = 1 ]; then
    exec "$PY" -m pytest -q "$@"
fi
log=$(mktemp)
"$PY" -m pytest -q -m "not sglang" "$@" > "$log" 2>&1 &
others=$!
trap 'kill "$others" 2>/dev/null; rm -f "$log"' EXIT
"$PY" -m pytest -q -m sglang "$@"
servers=$?
wait "$others"
others_rc=$?
echo
echo "==== the tests that start no SGLang server (run beside the ones above) ===="
cat "$log"
echo "run_tests: server tests exit $servers, the others exit $others_rc"
[ "$servers" -eq 0 ] && [ "$others_rc" -eq 0 ]
