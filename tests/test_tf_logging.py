"""TensorFlow's start-up noise is hidden in training processes stratkit starts, unless the user asks for it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from procs import child_env, run_process
from stratkit.tf_logging import StartupNoise, quiet_defaults

# Measured with TensorFlow 2.21 on a CPU machine: printed before TF configures its logging.
PRE_INIT = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
ONEDNN = ("I0000 00:00:1795432727.113016    6676 port.cc:153] oneDNN custom operations are on. You may see slightly "
          "different numerical results")
CUDA_STUB = "I0000 00:00:1795432727.113307    6676 cudart_stub.cc:31] Could not find cuda drivers on your machine"
CUINIT = ("E0000 00:00:1795432730.855739    6676 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          "Failed call to cuInit: UNKNOWN ERROR (303)")
REAL_ERROR = "E1123 11:20:01.123456   77 collective_ops.cc:12] Collective op failed: peer unreachable"


def test_the_default_level_is_added_only_when_the_user_did_not_set_one():
    assert quiet_defaults({}) == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    assert quiet_defaults({"TF_CPP_MIN_LOG_LEVEL": "0"}) == {}


@pytest.mark.parametrize("line", [PRE_INIT, ONEDNN, CUDA_STUB, CUINIT])
def test_start_up_noise_is_dropped_at_the_default_level_with_gpus_hidden(line):
    assert not StartupNoise({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}).keep(line)


def test_errors_and_user_output_are_kept():
    noise = StartupNoise({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    assert noise.keep(REAL_ERROR) and noise.keep("Epoch 1/3") and noise.keep("I0000 is how my model logs")


def test_a_cuda_error_is_kept_where_gpus_were_asked_for():
    assert StartupNoise({"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "0"}).keep(CUINIT)


def test_an_explicit_level_0_shows_everything():
    noise = StartupNoise({"TF_CPP_MIN_LOG_LEVEL": "0", "CUDA_VISIBLE_DEVICES": ""})
    assert all(noise.keep(line) for line in (PRE_INIT, ONEDNN, CUDA_STUB, CUINIT))


def test_the_cuinit_error_is_dropped_after_tensorflow_found_no_cuda_driver_but_kept_where_drivers_exist():
    noise = StartupNoise({"TF_CPP_MIN_LOG_LEVEL": "2"})  # a user's shell: GPUs not hidden
    assert noise.keep(CUINIT)                              # no sign yet that the machine has no driver
    assert not noise.keep(CUDA_STUB)                       # TF: "Could not find cuda drivers ... GPU will not be used"
    assert not noise.keep(CUINIT) and noise.keep(REAL_ERROR)


# A task srun started: stratkit filters TensorFlow's start-up lines inside the task itself.
SRUN_TASK = {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "TF_CPP_MIN_LOG_LEVEL": None,
             "CUDA_VISIBLE_DEVICES": None}
TAKE_TRAINER = ("import os, sys, stratkit\nstratkit.Trainer\n"
                "print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'), file=sys.stderr)\n")


@pytest.mark.slow
def test_an_srun_task_importing_tensorflow_through_stratkit_is_quiet():
    result = run_process(TAKE_TRAINER, env=SRUN_TASK, timeout=120, fork=False)  # its import is the test
    assert result.ok, result.stderr
    assert "absl::InitializeLog" not in result.stderr and "cuInit" not in result.stderr, result.stderr
    assert "level 2" in result.stderr


@pytest.mark.slow
def test_an_explicit_level_in_an_srun_task_wins():
    result = run_process(TAKE_TRAINER, env={**SRUN_TASK, "TF_CPP_MIN_LOG_LEVEL": "0"}, timeout=120, fork=False)
    assert result.ok, result.stderr
    assert "absl::InitializeLog" in result.stderr and "level 0" in result.stderr


def test_a_crash_inside_the_quiet_window_keeps_its_error():
    code = ("import os\nfrom stratkit.tf_logging import quiet_tensorflow_import\n"
            "with quiet_tensorflow_import():\n"
            f"    os.write(2, {PRE_INIT!r}.encode() + b'\\n')\n"
            "    os.write(2, b'F0000 00:00:1.0 1 x.cc:1] real fatal error\\nplain line\\n')\n"
            "    os._exit(3)\n")
    # stderr read to its end: the filter holds it until it has passed on everything
    result = subprocess.run([sys.executable, "-c", code], env=child_env(env={"TF_CPP_MIN_LOG_LEVEL": None}),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert result.stderr.splitlines() == ["F0000 00:00:1.0 1 x.cc:1] real fatal error", "plain line"]
