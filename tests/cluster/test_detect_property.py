"""Property: for ANY TF_CONFIG, `stratkit.detect()` either returns a sound ClusterSpec or raises ConfigError.

Nothing else may escape (no KeyError, TypeError, RecursionError, plain ValueError ...):
a malformed environment must always become a message naming the variable, the
bad value and the fix. When it returns, the spec is internally consistent and its
`to_tf_config()` describes the same task in the same cluster.

The generator mixes four families so that a good share of examples is valid
(checked deterministically by `test_generator_yields_many_valid_configs`):
  * valid by construction (random layouts of chief/master, workers, ps, listed or
    unlisted evaluator, unique addresses, extra keys) -- these MUST be accepted
    with the expected strategy and role;
  * the same, with one random corruption (bad port, unknown role, odd index, ...);
  * random clusters and tasks built from random roles, addresses and indices;
  * random JSON values and random (mostly non-JSON) strings.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import stratkit
from stratkit import ConfigError
from stratkit.cluster import ROLES, STRATEGIES

HOSTS = st.sampled_from(["a", "b", "host-1", "10.0.0.1", "192.168.7.20", "[::1]", "[2001:db8::7]",
                         "node01.example.com", "algo-1", "mnist-worker-0.kubeflow.svc", "GPU_node"])
GOOD_PORTS = st.integers(1, 65535)
ROLE_NAMES = st.one_of(
    st.sampled_from(ROLES + ("master",)),
    st.sampled_from(["Worker", "CHIEF", "trainer", "", "ps ", "master0", "evaluators"]),
    st.text(max_size=6),
)
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.integers(), st.floats(),
                         st.text(max_size=10))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
ANY_ADDRESS = st.one_of(
    st.builds("{}:{}".format, HOSTS, GOOD_PORTS),
    st.builds("{}:{}".format, HOSTS, st.integers(-100, 0) | st.integers(65536, 10**7)),
    st.builds("{}:{}".format, HOSTS, st.text(max_size=5)),
    HOSTS,
    st.builds("{}:".format, HOSTS),
    st.builds("grpc://{}:{}".format, HOSTS, GOOD_PORTS),
    st.builds(" {}:{}".format, HOSTS, GOOD_PORTS),
    st.text(max_size=12),
)
ANY_INDEX = st.one_of(st.integers(-3, 6), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3),
                      st.none(), st.just(10**20), st.lists(st.integers(0, 2), max_size=2))
EXTRA_KEYS = st.dictionaries(st.text(max_size=10).filter(lambda k: k not in ("cluster", "task")), JSON_VALUES,
                             max_size=3)


@st.composite
def valid_configs(draw: st.DrawFn) -> tuple[dict, dict]:
    """A TF_CONFIG object that must be accepted, and what detect() must say about it."""
    n_ps = draw(st.integers(0, 3))
    n_workers = draw(st.integers(1 if n_ps else 0, 5))
    has_chief = n_ps > 0 or n_workers == 0 or draw(st.booleans())
    chief_name = draw(st.sampled_from(["chief", "master"]))
    evaluator = draw(st.sampled_from(["none", "listed", "unlisted"]))
    sizes = {chief_name: int(has_chief), "worker": n_workers, "ps": n_ps, "evaluator": int(evaluator == "listed")}
    sizes = {role: n for role, n in sizes.items() if n}
    total = sum(sizes.values())
    endpoints = draw(st.lists(st.tuples(HOSTS, GOOD_PORTS), min_size=total, max_size=total, unique=True))
    addresses = iter(f"{host}:{port}" for host, port in endpoints)
    roles = list(sizes)
    draw(st.randoms()).shuffle(roles)
    cluster = {role: [next(addresses) for _ in range(sizes[role])] for role in roles}

    tasks = [(role, i) for role, n in sizes.items() for i in range(n)]
    if evaluator == "unlisted":
        tasks.append(("evaluator", 0))
    raw_type, index = draw(st.sampled_from(tasks))
    if raw_type == "master" and draw(st.booleans()):
        raw_type = "chief"  # a task may already say "chief" when the cluster still says "master"
    task = {"type": raw_type, "index": index, **draw(st.dictionaries(st.sampled_from(["cloud", "trial"]),
                                                                    st.text(max_size=5), max_size=2))}
    config = {**draw(EXTRA_KEYS), "cluster": cluster, "task": task}

    task_type = "chief" if raw_type == "master" else raw_type
    has_chief_role = has_chief
    expected = {
        "strategy": "parameter_server" if n_ps else "multi_worker_mirrored",
        "task_type": task_type,
        "task_index": index,
        "is_chief": task_type == "chief" or (task_type == "worker" and index == 0 and not has_chief_role),
        "num_workers": int(has_chief) + n_workers,
        "cluster": {("chief" if r == "master" else r): a for r, a in cluster.items()},
    }
    return config, expected


def _corrupt(config: dict, how: str, data: st.DataObject) -> dict:
    config = json.loads(json.dumps(config))
    cluster, task = config["cluster"], config["task"]
    role = data.draw(st.sampled_from(sorted(cluster)), label="role")
    if how == "address":
        cluster[role][data.draw(st.integers(0, len(cluster[role]) - 1))] = data.draw(ANY_ADDRESS, label="address")
    elif how == "duplicate":
        other = data.draw(st.sampled_from(sorted(cluster)), label="other role")
        cluster[other].append(cluster[role][0])
    elif how == "role-value":
        cluster[role] = data.draw(JSON_VALUES, label="role value")
    elif how == "extra-role":
        cluster[data.draw(ROLE_NAMES, label="new role")] = data.draw(st.lists(ANY_ADDRESS, max_size=2))
    elif how == "drop-role":
        del cluster[role]
    elif how == "index":
        task["index"] = data.draw(ANY_INDEX, label="index")
    elif how == "type":
        task["type"] = data.draw(ROLE_NAMES | JSON_SCALARS, label="type")
    elif how == "drop-task-key":
        task.pop(data.draw(st.sampled_from(["type", "index"])), None)
    elif how == "task":
        config["task"] = data.draw(JSON_VALUES, label="task")
    elif how == "cluster":
        config["cluster"] = data.draw(JSON_VALUES, label="cluster")
    return config


@st.composite
def random_structured(draw: st.DrawFn) -> dict:
    cluster = draw(st.dictionaries(ROLE_NAMES, st.lists(ANY_ADDRESS, max_size=3) | JSON_VALUES, max_size=4))
    task = draw(st.fixed_dictionaries({}, optional={"type": ROLE_NAMES | JSON_SCALARS, "index": ANY_INDEX}))
    config = {**draw(EXTRA_KEYS), "cluster": cluster, "task": task}
    for key in draw(st.sets(st.sampled_from(["cluster", "task"]), max_size=1)):
        del config[key]
    return config


def _near_json(text: str, data: st.DataObject) -> str:
    """Truncate or splice a character into valid JSON text."""
    cut = data.draw(st.integers(0, len(text)), label="cut")
    if data.draw(st.booleans(), label="truncate"):
        return text[:cut]
    return text[:cut] + data.draw(st.sampled_from(list("{}[]\",:'x \\")), label="char") + text[cut:]


@st.composite
def tf_config_texts(draw: st.DrawFn) -> tuple[str, str, dict | None]:
    """(family, TF_CONFIG text, expected fields or None when validity is not known in advance)."""
    data = draw(st.data())
    family = draw(st.sampled_from(["valid", "valid", "valid", "corrupted", "corrupted", "structured",
                                   "json", "text", "near-json", "huge-number"]))
    if family == "valid":
        config, expected = draw(valid_configs())
        text = json.dumps(config, indent=draw(st.sampled_from([None, 2])))
        return family, text, expected
    if family == "corrupted":
        config, _ = draw(valid_configs())
        how = draw(st.sampled_from(["address", "duplicate", "role-value", "extra-role", "drop-role", "index",
                                    "type", "drop-task-key", "task", "cluster"]))
        return f"{family}:{how}", json.dumps(_corrupt(config, how, data)), None
    if family == "structured":
        return family, json.dumps(draw(random_structured())), None
    if family == "json":
        return family, json.dumps(draw(JSON_VALUES)), None
    if family == "near-json":
        config, _ = draw(valid_configs())
        return family, _near_json(json.dumps(config), data), None
    if family == "huge-number":
        config, _ = draw(valid_configs())
        return family, _with_huge_number(json.dumps(config), data), None
    return family, draw(st.text(max_size=40)), None


def _with_huge_number(text: str, data: st.DataObject) -> str:
    """Put an integer longer than Python converts (or a port with as many digits) somewhere in valid JSON."""
    digits = data.draw(st.sampled_from(["9" * 5000, "1" + "0" * 4300, "0" * 5000 + "7"]), label="digits")
    where = data.draw(st.sampled_from(["index", "port", "value"]), label="where")
    if where == "index":
        return re.sub(r'"index": \d+', f'"index": {digits.lstrip("0") or "0"}', text)
    if where == "port":
        return re.sub(r':\d+"', f':{digits}"', text, count=1)
    return text[:-1] + f', "n": -{digits.lstrip("0") or "0"}}}'


FIELDS = ("strategy", "task_type", "task_index", "cluster", "is_chief", "num_workers")


def _outcome(text: str) -> tuple[str, Any]:
    """("valid" | "no-cluster" | "error", spec or ConfigError); any other exception propagates."""
    try:
        spec = stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": text})
    except ConfigError as error:
        return "error", error
    return ("valid" if spec.cluster else "no-cluster"), spec


def _check_sound(spec: stratkit.ClusterSpec) -> None:
    cluster = spec.cluster
    assert spec.strategy in STRATEGIES
    assert spec.strategy == ("parameter_server" if "ps" in cluster else "multi_worker_mirrored")
    assert spec.source in ("tf_config", "sagemaker")
    assert set(cluster) <= set(ROLES) and all(cluster.values())
    assert len(cluster.get("chief", [])) <= 1 and len(cluster.get("evaluator", [])) <= 1
    addresses = [a for tasks in cluster.values() for a in tasks]
    assert len(addresses) == len(set(addresses))
    for address in addresses:
        host, _, port = address.rpartition(":")
        assert host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535, address
    assert spec.task_type in ROLES
    assert isinstance(spec.task_index, int) and not isinstance(spec.task_index, bool)
    if spec.task_type in cluster:
        assert 0 <= spec.task_index < len(cluster[spec.task_type])
    else:
        assert (spec.task_type, spec.task_index) == ("evaluator", 0)
    assert spec.num_workers == len(cluster.get("chief", [])) + len(cluster.get("worker", [])) >= 1
    assert spec.is_chief == (spec.task_type == "chief"
                             or (spec.task_type == "worker" and spec.task_index == 0 and "chief" not in cluster))
    if "ps" in cluster:
        assert "chief" in cluster and "worker" in cluster


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tf_config_texts())
def test_detect_returns_a_sound_spec_or_raises_config_error(case: tuple[str, str, dict | None]) -> None:
    family, text, expected = case
    note(f"family={family} TF_CONFIG={text!r}")
    outcome, result = _outcome(text)
    event(f"{family.split(':')[0]} -> {outcome}")

    if outcome == "error":
        assert expected is None, f"a valid TF_CONFIG was rejected: {result}"
        message = str(result)
        assert "TF_CONFIG" in message and "Fix" in message, message
        return

    spec = result
    if outcome == "no-cluster":
        assert expected is None
        assert (spec.strategy, spec.source, spec.to_tf_config()) == ("one_device", "local", "{}")
        return

    _check_sound(spec)
    if expected is not None:
        assert {f: getattr(spec, f) for f in FIELDS} == expected

    again = stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": spec.to_tf_config()})
    assert {f: getattr(again, f) for f in FIELDS} == {f: getattr(spec, f) for f in FIELDS}
    assert again.to_tf_config() == spec.to_tf_config()


def test_generator_yields_many_valid_configs() -> None:
    """The property above is only worth something if plenty of its examples get through."""
    outcomes: list[str] = []

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=tf_config_texts())
    def collect(case: tuple[str, str, dict | None]) -> None:
        outcomes.append(_outcome(case[1])[0])

    collect()
    share = outcomes.count("valid") / len(outcomes)
    assert share >= 0.25, f"only {share:.0%} of {len(outcomes)} generated TF_CONFIGs were valid"
    assert outcomes.count("error") / len(outcomes) >= 0.25


# A wider property: random overrides, detection modes and scheduler variables around TF_CONFIG.

STRATEGY_NAMES = st.one_of(st.none(), st.sampled_from(["mirrored", "MirroredStrategy", "mwms", "ps", "tpu",
                                                       "one_device", "OneDeviceStrategy", "", "horovod",
                                                       "Strategy"]), st.text(max_size=8))
# Hostile sizes too: a host list or count that would expand to millions of entries, and integers
# longer than Python converts (4300 digits). detect() must answer those with a ConfigError at once.
HUGE_NUMBERS = st.sampled_from(["999999999", "9" * 40, "9" * 5000, "0" * 5000 + "2"])
SMALL_NUMBERS = st.one_of(st.integers(-2, 6).map(str), st.text(alphabet="0123456789-x ", max_size=3),
                          HUGE_NUMBERS)
HOSTLISTS = st.one_of(st.sampled_from(["n[1-2]", "node[01-03,07]", "rack[1-2]-n[01-02]", "a,b", "n[", "n[2-1]", "",
                                       ",", "n[0-999999999]", "a[0-99999]b[0-99999]", "n[1-2]" * 40,
                                       f"n[0-{'9' * 5000}]", "n[0-65535]"]),
                      st.text(alphabet="ab[]-,0123456789", max_size=30))


@st.composite
def slurm_steps(draw: st.DrawFn) -> dict[str, str]:
    """A consistent srun step (nodes, tasks per node, rank), sometimes with one variable replaced."""
    per_node = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    prefix = draw(st.sampled_from(["node", "gpu", "rack1-n"]))
    width = draw(st.integers(1, 3))
    nodelist = f"{prefix}[{','.join(str(i + 1).zfill(width) for i in range(len(per_node)))}]"
    step = {
        "SLURM_PROCID": str(draw(st.integers(0, sum(per_node) - 1))),
        "SLURM_STEP_NUM_TASKS": str(sum(per_node)),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": ",".join(map(str, per_node)),
    }
    if draw(st.booleans()):
        step[draw(st.sampled_from(sorted(step)))] = draw(SMALL_NUMBERS | HOSTLISTS)
    return step


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tf_config=st.none() | tf_config_texts().map(lambda case: case[1]),
    strategy=STRATEGY_NAMES,
    slurm=st.none() | slurm_steps(),
    variables=st.fixed_dictionaries({}, optional={
        "STRATKIT_STRATEGY": STRATEGY_NAMES.map(lambda v: v or ""),
        "STRATKIT_CLUSTER_ENV": st.sampled_from(["auto", "none", "NONE", "tf_config", "tpu", "slurm", "local",
                                                 "", "bogus"]),
        "STRATKIT_LAUNCHER": st.sampled_from(["launch", "spark", "x"]),
        "TPU_NAME": st.sampled_from(["my-tpu", " ", ""]),
        "COLAB_TPU_ADDR": st.sampled_from(["10.0.0.2:8470", ""]),
        "CUDA_VISIBLE_DEVICES": st.sampled_from(["", "-1", "0", "0,1", "0,1,2"]),
        "SLURM_PROCID": SMALL_NUMBERS,
        "SLURM_STEP_NUM_TASKS": SMALL_NUMBERS,
        "SLURM_STEP_NODELIST": HOSTLISTS,
        "SLURM_STEP_TASKS_PER_NODE": st.sampled_from(["1", "2", "1(x2)", "2(x2)", "2(x3),1", "x", "",
                                                      "1(x999999999)", f"1(x{'9' * 5000})", "9" * 5000]),
        "SLURM_JOB_NUM_NODES": SMALL_NUMBERS,
        "SLURM_NNODES": SMALL_NUMBERS,
        "STRATKIT_SLURM_PORT": st.sampled_from(["8888", "65535", "0", "port"]),
    }),
)
def test_detect_never_raises_anything_but_config_error(tf_config, strategy, slurm, variables) -> None:
    environ = {"CUDA_VISIBLE_DEVICES": "", **(slurm or {}), **variables}
    if tf_config is not None:
        environ["TF_CONFIG"] = tf_config
    note(f"environ={environ!r} strategy={strategy!r}")
    try:
        spec = stratkit.detect(environ, strategy=strategy)
    except ConfigError as error:
        assert "Fix" in str(error)
        event("ConfigError")
        return
    event(f"{spec.source} -> {spec.strategy}")
    assert spec.strategy in STRATEGIES
    assert spec.source in ("tf_config", "sagemaker", "slurm", "tpu", "local", "launch", "spark")
    if spec.cluster:
        _check_sound_cluster_fields(spec)
    else:
        assert (spec.task_type, spec.is_chief, spec.num_workers) == (None, True, 1)
    if spec.source == "slurm":
        assert list(spec.cluster) == ["worker"] and spec.task_index == int(environ["SLURM_PROCID"])
    hash(spec)
    json.loads(spec.to_tf_config())


def _check_sound_cluster_fields(spec: stratkit.ClusterSpec) -> None:
    assert spec.num_workers == len(spec.cluster.get("chief", [])) + len(spec.cluster.get("worker", []))
    if "ps" in spec.cluster:
        assert spec.strategy == "parameter_server"
    elif spec.num_workers > 1:
        assert spec.strategy == "multi_worker_mirrored"


@pytest.mark.parametrize("depth", [50, 2000, 100_000])
def test_deeply_nested_tf_config_is_a_config_error(depth: int) -> None:
    """json.loads raises RecursionError on deep nesting; that must surface as ConfigError too."""
    for text in ("[" * depth + "]" * depth,
                 '{"cluster": {"worker": ' + "[" * depth + "]" * depth + "}}",
                 '{"cluster": {"worker": ["a:1"]}, "task": ' + "[" * depth + "]" * depth + "}"):
        with pytest.raises(ConfigError, match="TF_CONFIG"):
            stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": text})
