"""Edge cases found by review after the main tables were written."""

from __future__ import annotations

import json

import pytest

import stratkit
from stratkit.errors import ConfigError


def test_the_bare_word_strategy_is_not_a_strategy():
    with pytest.raises(ConfigError, match=r"strategy='Strategy' is not a strategy.*Fix: use one of"):
        stratkit.detect({}, strategy="Strategy")


def test_an_empty_strategy_variable_means_not_set():
    assert stratkit.detect({"STRATKIT_STRATEGY": "  "}).strategy == "one_device"


@pytest.mark.parametrize("a, b", [("h:2222", "h:02222"), ("Host:2222", "host:2222")])
def test_two_spellings_of_one_endpoint_are_a_duplicate(a, b):
    config = {"cluster": {"worker": [a, b]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(ConfigError, match=r"TF_CONFIG uses address .* for both worker\[0\] and worker\[1\]"):
        stratkit.detect({"TF_CONFIG": json.dumps(config)})


def test_tf_config_command_names_its_flags_on_bad_input(capsys):
    from stratkit.cli import main

    assert main(["tf-config", "--cluster", "worker=h1", "--task", "worker:0"]) == 2
    err = capsys.readouterr().err
    assert "--cluster/--task" in err and "without a port" in err and "Fix:" in err
    assert main(["tf-config", "--cluster", "worker=h1:1,h2:2", "--task", "worker:1", "--export"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("export TF_CONFIG='") and '"index": 1' in out
