#!/usr/bin/env bash
# `make test`: the suite in two pytest streams side by side. The tests that start real SGLang
# servers (marker `sglang`) run one after another within a stream; a server test keeps about
# one core busy, so two streams fill a 2-core machine.
#
#   stream 1: the server tests, but for the short ones below;
#   stream 2: every test that starts no server, then the short server tests.
#
# The split balances the two. Measured from a clean clone on a 2-core machine, the streams
# side by side (the server tests of plumbing serving `plumbing_model`, tests/conftest.py):
# stream 1 49 minutes, of which the PD log-prob test 10.5, the demo 7, SmolLM2's compaction
# test 5; stream 2's tests without a server 34 minutes (the GPU preflight, wheelhouse packing
# included, 11), then its short server tests 15. Stream 2's output is printed when both have
# finished; the exit status is non-zero if any pytest run failed (pytest's 5, "no test ran",
# included).
#
#   bash scripts/run_tests.sh [PYTEST ARGS]    # PY: the interpreter (default .venv/bin/python)
#   TEST_STREAMS=1 bash scripts/run_tests.sh   # one process, every test
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${TEST_STREAMS:-2}" = 1 ]; then
    exec "$PY" -m pytest -q "$@"
fi
SHORT_SERVER_TESTS=(  # one server each, ~1-3 minutes a file on CI
    tests/integration/test_plugin_hub_id.py
    tests/integration/test_plugin_packed_memory.py
    tests/integration/test_plugin_refit.py
    tests/integration/test_plugin_replicas.py
    tests/integration/test_plugin_tenants.py
    tests/integration/test_sglang_server.py
    tests/sglang_ext/test_sglang_surface.py
)
log=$(mktemp)
show_others() {
    echo
    echo "==== stream 2: the tests that start no SGLang server, then the short server tests ===="
    cat "$log"
}
stream2() {
    "$PY" -m pytest -q -m "not sglang" "$@"
    local rc=$?
    echo
    echo "==== stream 2: the short server tests ===="
    "$PY" -m pytest -q -m sglang "$@" "${SHORT_SERVER_TESTS[@]}" || return $?
    return $rc
}
stream2 "$@" > "$log" 2>&1 &
others=$!
"$PY" -m pytest -q -m sglang "${SHORT_SERVER_TESTS[@]/#/--ignore=}" "$@" &
servers_pid=$!
stop_all() { pkill -P "$others" 2>/dev/null; kill "$others" "$servers_pid" 2>/dev/null; }
trap 'stop_all; rm -f "$log"' EXIT
# Stopped from outside (a time limit): what stream 2 did so far is printed too.
trap 'echo; echo "run_tests: stopped by a signal"; show_others; exit 143' TERM INT
wait "$servers_pid"
servers=$?
wait "$others"
others_rc=$?
show_others
echo "run_tests: stream 1 (server tests) exit $servers, stream 2 exit $others_rc"
[ "$servers" -eq 0 ] && [ "$others_rc" -eq 0 ]
