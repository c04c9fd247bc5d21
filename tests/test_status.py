"""Status lines: today's console for users who never configured logging, one copy for those who did."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, check=True)


def test_without_logging_config_status_goes_to_stdout_and_warnings_to_stderr():
    out = _run("""
        from stratkit import status
        log = status.logger("stratkit.training.backup")
        log.info("resumed from /x at epoch 3")
        log.warning("backup is older than the model")
        log.debug("not shown")
    """)
    assert out.stdout == "[stratkit] resumed from /x at epoch 3\n"
    assert out.stderr == "[stratkit] warning: backup is older than the model\n"


def test_a_users_console_handler_gets_each_record_once():
    out = _run("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(name)s|%(message)s")
        from stratkit import status
        status.logger("stratkit.strategy.server").info("worker:0 serving")
    """)
    assert out.stdout == "stratkit.strategy.server|worker:0 serving\n"
    assert out.stderr == ""


def test_the_user_can_silence_status_lines_and_keep_warnings():
    out = _run("""
        import logging
        from stratkit import status
        log = status.logger("evaluator")
        logging.getLogger("stratkit").setLevel(logging.WARNING)
        log.info("hidden")
        log.warning("kept")
    """)
    assert out.stdout == ""
    assert out.stderr == "[stratkit] warning: kept\n"


def test_a_hushed_block_keeps_its_status_lines_and_warnings_from_every_handler_but_not_its_errors():
    """What every worker works out alike is said by the chief: the others plan inside `hushed()`; a handler of the
    user's gets nothing from the block either, and lines after it are said again."""
    out = _run("""
        import logging, sys
        logging.getLogger().addHandler(logging.StreamHandler(sys.stdout))
        from stratkit import status
        log = status.logger("stratkit.data.sources.files")
        with status.hushed(False):
            log.warning("said: not hushed")
        with status.hushed():
            log.info("hidden status")
            log.warning("hidden warning")
            with status.hushed(False):
                log.warning("hidden: an inner block does not unhush")
            log.error("said: an error")
        log.warning("said: after the block")
    """)
    assert out.stdout == "said: not hushed\nsaid: an error\nsaid: after the block\n", out.stdout
    assert "hidden" not in out.stderr


def test_a_closed_stdout_never_fails_the_caller():
    out = _run("""
        import sys
        from stratkit import status
        sys.stdout.close()
        status.logger("x").info("into a closed stream")
        sys.stderr.write("survived\\n")
    """)
    assert out.stderr.endswith("survived\n")


def test_usr1_is_a_preemption_notice_inside_a_slurm_job_unless_another_signal_is_named():
    # Slurm's --signal=USR1@N (and examples/slurm_requeue.sh's hand-over from B:USR1) reaches the tasks as USR1,
    # whose default action would end them with no backup
    from stratkit.status import preemption_signals

    assert preemption_signals({}) == (signal.SIGTERM,)
    assert preemption_signals({"SLURM_JOB_ID": "7"}) == (signal.SIGTERM, signal.SIGUSR1)
    assert preemption_signals({"SLURM_JOB_ID": "7", "STRATKIT_PREEMPTION_SIGNAL": "USR2"}) == (
        signal.SIGTERM, signal.SIGUSR2)
    assert preemption_signals({"SLURM_JOB_ID": "7", "STRATKIT_PREEMPTION_SIGNAL": "TERM"}) == (signal.SIGTERM,)
