"""`stratkit.process.report`: one wording of exit codes, one root-cause report format for every front door."""

from __future__ import annotations

from stratkit.process.report import TaskFailure, describe_returncode, format_failure_report, signal_name


def test_return_codes_in_words_with_the_usual_cause():
    assert describe_returncode(0) == "exited with code 0"
    assert describe_returncode(-9) == ("killed by SIGKILL (signal 9) -- often out of memory (the kernel's OOM killer "
                                       "sends SIGKILL): check `dmesg` or the container's memory limit, or lower the "
                                       "batch size")
    assert describe_returncode(139).startswith("exited with code 139 (128 + 11: a program it ran was killed by SIGSEGV")
    assert signal_name(999) == "signal 999"


def test_the_report_names_task_reason_exception_tail_and_the_others_under_the_callers_title():
    failure = TaskFailure("worker:1", 1, ("step 3", "ValueError: bad"), pid=42, address="127.0.0.1:5000",
                          attempt=1, exception=("ValueError: bad",))
    report = format_failure_report(failure, ["worker:0 (pid 41): stopped"], attempts=3, title="stratkit spark")
    lines = report.splitlines()
    assert lines[1] == "stratkit spark: root cause (first observed failure)"
    assert "task:    worker:1 (pid 42, 127.0.0.1:5000), attempt 2 of 3" in lines
    assert "failure: exited with code 1" in lines and "exception: ValueError: bad" in lines
    assert lines[lines.index("last 2 line(s) of worker:1:") + 1] == "  | step 3"
    assert lines[-3:-1] == ["other tasks:", "  worker:0 (pid 41): stopped"]


def test_a_timeout_and_a_callers_own_wording_replace_the_exit_code():
    hung = TaskFailure("worker:0", None, timed_out_after=60, timeout_setting="timeout=")
    assert hung.reason.startswith("still running after timeout=60 s (hung?")
    assert TaskFailure("worker:0", None, timed_out_after=5).reason.startswith("still running after --timeout 5 s")
    setup = TaskFailure("worker:2", 99, ended="the task failed before its training process started")
    assert "failure: the task failed before its training process started" in format_failure_report(setup)
    assert "worker:2 printed nothing." in format_failure_report(setup)
