"""Hostile sizes in the environment: `detect()` answers with a ConfigError at once, never a MemoryError or a hang.

A Slurm host list is a compact notation (`n[0-999999999]` is a billion
hosts), and Python refuses to convert integers with more than 4300 digits;
both must be checked before anything is built from them.

The Slurm cases run in a child interpreter with a 1 GiB address-space limit,
so a regression fails fast with MemoryError instead of swapping the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import stratkit
from stratkit.cluster import slurm
from stratkit.errors import ConfigError

STEP = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "CUDA_VISIBLE_DEVICES": ""}
HUGE = "9" * 5000  # more digits than sys.get_int_max_str_digits() (4300) allows to convert


def detect_in_limited_child(environ: dict[str, str]) -> tuple[str, str, float]:
    """detect(environ) in a child with 1 GiB of address space; returns (outcome, message, seconds)."""
    code = textwrap.dedent("""
        import json, resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        import stratkit
        environ = json.loads(sys.stdin.read())
        started = time.monotonic()
        try:
            stratkit.detect(environ)
            outcome, message = "ok", ""
        except stratkit.ConfigError as error:
            outcome, message = "ConfigError", str(error)
        except BaseException as error:
            outcome, message = type(error).__name__, str(error)[:300]
        print(json.dumps([outcome, message, time.monotonic() - started]))
    """)
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(environ), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    outcome, message, seconds = json.loads(done.stdout)
    return outcome, message, seconds


@pytest.mark.parametrize("variables, named", [
    ({"SLURM_STEP_NODELIST": "n[0-999999999]"}, "SLURM_STEP_NODELIST='n[0-999999999]'"),
    ({"SLURM_STEP_NODELIST": "a[0-99999]b[0-99999]c[0-99999]"}, "SLURM_STEP_NODELIST"),  # a product of ranges
    ({"SLURM_STEP_NODELIST": "n[0-99999999999999999999999999]"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_NODELIST": f"n[0-{HUGE}]"}, "SLURM_STEP_NODELIST"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x999999999)"}, "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_STEP_TASKS_PER_NODE": f"1(x{HUGE})"}, "SLURM_STEP_TASKS_PER_NODE"),
    ({"SLURM_STEP_NUM_TASKS": "999999999", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": ""},
     "SLURM_STEP_NUM_TASKS"),
    ({"SLURM_STEP_NUM_TASKS": HUGE}, "SLURM_STEP_NUM_TASKS"),
])
def test_a_slurm_variable_that_expands_beyond_reason_is_a_config_error_at_once(variables, named):
    outcome, message, seconds = detect_in_limited_child({**STEP, **variables})
    assert outcome == "ConfigError", (outcome, message)
    assert named in message and "Fix:" in message, message
    assert len(message) < 1500, "the message must not echo a huge value in full"
    assert seconds < 1.0, f"took {seconds:.2f}s: the list was materialised"


def test_more_hosts_than_the_job_has_nodes_names_the_node_count():
    environ = {**STEP, "SLURM_STEP_NODELIST": "n[1-40]", "SLURM_STEP_NUM_TASKS": "40",
               "SLURM_STEP_TASKS_PER_NODE": "1(x40)", "SLURM_JOB_NUM_NODES": "4"}
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST='n\[1-40\]' names 40 hosts.*"
                                          r"SLURM_JOB_NUM_NODES=4.*Fix:"):
        stratkit.detect(environ)
    environ.pop("SLURM_JOB_NUM_NODES")
    with pytest.raises(ConfigError, match=r"names 40 hosts.*SLURM_NNODES=2"):
        stratkit.detect({**environ, "SLURM_NNODES": "2"})
    assert len(stratkit.detect({**environ, "SLURM_NNODES": "40"}).cluster["worker"]) == 40


def test_a_big_but_real_host_list_still_expands():
    assert slurm.count_hostlist("n[0001-2048],gpu[1-8]x[1-4]") == 2048 + 32
    hosts = slurm.expand_hostlist("n[0001-2048],gpu[1-8]x[1-4]")
    assert len(hosts) == 2080 and hosts[0] == "n0001" and hosts[-1] == "gpu8x4"
    with pytest.raises(ConfigError, match="names 2080 hosts"):
        slurm.expand_hostlist("n[0001-2048],gpu[1-8]x[1-4]", max_hosts=2000)


@pytest.mark.parametrize("where", ["index", "port", "extra key", "cluster key"])
def test_an_integer_too_long_for_python_in_tf_config_is_a_config_error(where):
    config = '{"cluster": {"worker": ["a:2222", "b:2222"]}, "task": {"type": "worker", "index": 0}}'
    if where == "index":
        text = config.replace('"index": 0', f'"index": {HUGE}')
    elif where == "port":
        text = config.replace('"b:2222"', f'"b:{HUGE}"')
    elif where == "extra key":
        text = config[:-1] + f', "environment": {{"seed": -{HUGE}}}}}'
    else:
        text = config.replace('"worker": [', f'"worker": [{HUGE}, ')
    with pytest.raises(ConfigError) as info:
        stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": text})
    message = str(info.value)
    assert message.startswith("TF_CONFIG") and "Fix:" in message, message
    assert len(message) < 1000
    if where == "port":
        assert "outside 1..65535" in message, message
    else:
        assert "more than the 4300 digits" in message, message


def test_a_port_padded_with_thousands_of_zeros_is_refused_but_a_short_padding_is_its_port():
    config = {"cluster": {"worker": ["a:2222", f"b:{'0' * 5000}2222"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ConfigError, match=r'has port "000000000000...\(5004 characters\)" outside 1..65535'):
        stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": json.dumps(config)})
    config["cluster"]["worker"][1] = "b:02222"
    assert stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": json.dumps(config)}).num_workers == 2
