"""benchmarks/report/suite_time.py reads a run_tests.sh output: the total, each pytest
session's summary, the 15 slowest tests of both streams; a run cut short is refused."""

from __future__ import annotations

import pytest

from benchmarks.report.suite_time import read_log

LOG = """\
.[  240 s]   240 s tests/integration/test_demo.py::test_demo
============================= slowest 25 durations =============================
240.13s call     tests/integration/test_demo.py::test_demo
70.63s setup    tests/integration/test_plugin_faults.py::test_fault[honest]
24 passed, 1341 deselected, 2 warnings in 1510.22s (0:25:10)

==== stream 2: the tests that start no SGLang server, then the short server tests ====
============================= slowest 25 durations =============================
464.93s call     tests/benchmarks/test_gpu_preflight.py::test_preflight
1407 passed, 32 skipped, 35 deselected, 3 warnings in 1436.12s (0:23:56)
11 passed, 98 deselected, 2 warnings in 394.80s (0:06:34)

==== the 15 slowest tests of both streams ====
464.93s call     tests/benchmarks/test_gpu_preflight.py::test_preflight
run_tests: 1850 s in all
run_tests: stream 1 (server tests) exit 0, stream 2 exit 0
"""


def test_reads_the_run() -> None:
    got = read_log(LOG)
    assert got["total_s"] == 1850 and got["stream_exits"] == [0, 0]
    assert [s["passed"] for s in got["sessions"]] == [24, 1407, 11]
    assert got["sessions"][1] == {"passed": 1407, "skipped": 32, "seconds": 1436.12}
    assert got["slowest"][0] == {
        "seconds": 464.93,
        "test": "call tests/benchmarks/test_gpu_preflight.py::test_preflight",
    }
    assert [s["seconds"] for s in got["slowest"]][:3] == [464.93, 240.13, 70.63]


def test_reads_the_whole_ci_run_when_the_log_is_ci_runs() -> None:
    assert (read_log(LOG)["ci_s"], read_log(LOG)["setup_s"]) == (None, None)  # make test's
    got = read_log(LOG + "ci: 2100 s in all (setup and lint 250 s)\n")
    assert (got["ci_s"], got["setup_s"], got["total_s"]) == (2100, 250, 1850)


def test_a_run_cut_short_is_refused() -> None:
    with pytest.raises(ValueError, match="cut short"):
        read_log(LOG.split("run_tests:")[0])
