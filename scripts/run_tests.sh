#!/usr/bin/env bash
# `make test`: the suite in two pytest streams side by side. The tests that start real SGLang
# servers (marker `sglang`) run one after another within a stream; a server test keeps about
# one core busy, so two streams fill a 2-core machine.
#
#   stream 1: the server tests, but for the short ones below;
#   stream 2: every test that starts no server, then the short server tests.
#
# The split balances the two: stream 1 holds the long server tests (the demo, the GPU-run
# smoke on CPU servers, SmolLM2's compaction test, the PD pairs), stream 2 the tests without
# a server (the GPU preflight, wheelhouse packing included, and the quick RULER suite are the
# longest), then the short server tests. What a fresh clone's run took on a 2-core machine:
# benchmarks/results/suite_time.json. Stream 2's output is printed when both have finished,
# then the 15 slowest tests of both streams and the total time; the exit status is non-zero
# if any pytest run failed (pytest's 5, "no test ran", included).
#
#   bash scripts/run_tests.sh [PYTEST ARGS]    # PY: the interpreter (default .venv/bin/python)
#   TEST_STREAMS=1 bash scripts/run_tests.sh   # one process, every test
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${TEST_STREAMS:-2}" = 1 ]; then
    exec "$PY" -m pytest -q "$@"
fi
SHORT_SERVER_TESTS=(  # one server each, under a minute a file here
    tests/integration/test_plugin_replicas.py
    tests/integration/test_sglang_server.py
    tests/sglang_ext/test_sglang_surface.py
)
log=$(mktemp)
servers_log=$(mktemp)
started=$(date +%s)
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
"$PY" -m pytest -q -m sglang "${SHORT_SERVER_TESTS[@]/#/--ignore=}" "$@" > >(tee "$servers_log") 2>&1 &
servers_pid=$!
stop_all() { pkill -P "$others" 2>/dev/null; kill "$others" "$servers_pid" 2>/dev/null; }
trap 'stop_all; rm -f "$log" "$servers_log"' EXIT
# Stopped from outside (a time limit): what stream 2 did so far is printed too.
trap 'echo; echo "run_tests: stopped by a signal"; show_others; exit 143' TERM INT
wait "$servers_pid"
servers=$?
wait "$others"
others_rc=$?
show_others
echo
echo "==== the 15 slowest tests of both streams ===="
grep -hE '^[0-9.]+s (call|setup|teardown) ' "$servers_log" "$log" | sort -rn | head -15
echo "run_tests: $(( $(date +%s) - started )) s in all"
echo "run_tests: stream 1 (server tests) exit $servers, stream 2 exit $others_rc"
[ "$servers" -eq 0 ] && [ "$others_rc" -eq 0 ]
