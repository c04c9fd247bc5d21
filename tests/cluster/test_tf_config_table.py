"""TF_CONFIG as it appears in the wild -> the ClusterSpec `stratkit.detect()` must return.

Specification (issue "one rule for where am I running"):

* A TF_CONFIG cluster with a "ps" role means parameter_server for *every*
  task in it; chief/worker only means multi_worker_mirrored (a one-worker
  cluster is valid). An evaluator gets the cluster's strategy, with
  task_type "evaluator" and is_chief False.
* The chief is the "chief" task, else worker 0 when the cluster has no chief.
* num_workers counts the training tasks: chief + workers.
* SageMaker's "master" role is read as "chief" and the source is "sagemaker";
  "environment": "cloud" and other unknown top-level keys are accepted.
* Anything malformed raises `stratkit.ConfigError` (a ValueError) whose message
  names TF_CONFIG, shows the offending value and says how to fix it.

The second half of this file checks every valid row against TensorFlow's own
`TFConfigClusterResolver` and `multi_worker_util.is_chief`. TensorFlow is
imported only by those tests (through a fixture), so the tables run without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

import stratkit
from stratkit import ConfigError


@dataclass(frozen=True)
class Valid:
    """One valid TF_CONFIG and the spec it must produce."""

    id: str
    tf_config: Any  # a dict (dumped to JSON) or the raw string
    strategy: str
    task_type: str
    task_index: int
    is_chief: bool
    num_workers: int
    source: str = "tf_config"
    env: dict = field(default_factory=dict)  # other variables the platform sets

    def text(self) -> str:
        return self.tf_config if isinstance(self.tf_config, str) else json.dumps(self.tf_config)

    def environ(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": "", **self.env, "TF_CONFIG": self.text()}


def tf_config(cluster: dict, task_type: str, index: int, **extra: Any) -> dict:
    return {"cluster": cluster, "task": {"type": task_type, "index": index}, **extra}


PS = "parameter_server"
MWMS = "multi_worker_mirrored"

# --- Kubeflow TFJob: one Service per replica, DNS names, "environment": "cloud".
KUBEFLOW_PS = {
    "chief": ["mnist-chief-0.kubeflow.svc:2222"],
    "worker": ["mnist-worker-0.kubeflow.svc:2222", "mnist-worker-1.kubeflow.svc:2222"],
    "ps": ["mnist-ps-0.kubeflow.svc:2222", "mnist-ps-1.kubeflow.svc:2222"],
    "evaluator": ["mnist-evaluator-0.kubeflow.svc:2222"],
}
KUBEFLOW_MWMS = {"worker": [f"dist-mnist-worker-{i}.default.svc.cluster.local:2222" for i in range(3)]}
KUBEFLOW_CHIEF_WORKER = {
    "chief": ["resnet-chief-0.team-a.svc:2222"],
    "worker": ["resnet-worker-0.team-a.svc:2222", "resnet-worker-1.team-a.svc:2222"],
}

# --- SageMaker parameter-server mode: "master" (TF rejects it), ps on every host at 2223.
SAGEMAKER_PS_2 = {"master": ["algo-1:2222"], "ps": ["algo-1:2223", "algo-2:2223"], "worker": ["algo-2:2222"]}
SAGEMAKER_PS_3 = {"master": ["algo-1:2222"], "ps": ["algo-1:2223", "algo-2:2223", "algo-3:2223"],
                  "worker": ["algo-2:2222", "algo-3:2222"]}
SAGEMAKER_MWMS = {"worker": ["algo-1:7777", "algo-2:7777"]}
SAGEMAKER_ENV = {"SM_CURRENT_HOST": "algo-1", "SM_HOSTS": '["algo-1", "algo-2"]'}

# --- Google AI Platform: chief/worker/ps in the cluster, the evaluator NOT listed.
AI_PLATFORM_PS = {
    "chief": ["cmle-training-master-5f6d7e-0:2222"],
    "worker": ["cmle-training-worker-5f6d7e-0:2222", "cmle-training-worker-5f6d7e-1:2222"],
    "ps": ["cmle-training-ps-5f6d7e-0:2222"],
}
AI_PLATFORM_MWMS = {"chief": ["cmle-training-master-a1-0:2222"], "worker": ["cmle-training-worker-a1-0:2222"]}
AI_PLATFORM_EXTRA = {"environment": "cloud", "job": {"scale_tier": "CUSTOM", "master_type": "n1-standard-8"}}
AI_PLATFORM_TASK_EXTRA = {"cloud": "q9c4b0e6a1d2-ml", "trial": ""}

# --- Ray Train TensorflowTrainer and spark-tensorflow-distributor: every task a worker.
RAY = {"worker": ["10.0.0.11:41001", "10.0.0.12:41002", "10.0.0.13:41003", "10.0.0.14:41004"]}
SPARK_DISTRIBUTOR = {"worker": ["10.1.2.3:39617", "10.1.2.4:40123", "10.1.2.5:38811"]}

# --- stratkit's own launcher / Spark runner (they set STRATKIT_LAUNCHER next to TF_CONFIG).
LAUNCH_MWMS = {"worker": ["127.0.0.1:20001", "127.0.0.1:20002"]}
LAUNCH_PS = {"chief": ["127.0.0.1:21000"], "worker": ["127.0.0.1:21001", "127.0.0.1:21002"],
             "ps": ["127.0.0.1:21003"]}

BIG_PS = {"chief": ["c:1000"], "worker": [f"w{i}:1000" for i in range(4)], "ps": [f"p{i}:1000" for i in range(3)],
          "evaluator": ["e:1000"]}
SIXTEEN = {"worker": [f"node{i:02d}.cluster.example.com:2222" for i in range(16)]}

PRETTY = """
{
    "cluster": {
        "chief":  ["host-a:2222"],
        "worker": ["host-b:2222", "host-c:2222"]
    },
    "task": {"type": "worker", "index": 1}
}
"""

VALID = [
    # Kubeflow TFJob, PS with evaluator, every replica type.
    Valid("kubeflow-ps-chief", tf_config(KUBEFLOW_PS, "chief", 0, environment="cloud"), PS, "chief", 0, True, 3),
    Valid("kubeflow-ps-worker0", tf_config(KUBEFLOW_PS, "worker", 0, environment="cloud"), PS, "worker", 0, False, 3),
    Valid("kubeflow-ps-worker1", tf_config(KUBEFLOW_PS, "worker", 1, environment="cloud"), PS, "worker", 1, False, 3),
    Valid("kubeflow-ps-ps0", tf_config(KUBEFLOW_PS, "ps", 0, environment="cloud"), PS, "ps", 0, False, 3),
    Valid("kubeflow-ps-ps1", tf_config(KUBEFLOW_PS, "ps", 1, environment="cloud"), PS, "ps", 1, False, 3),
    Valid("kubeflow-ps-evaluator", tf_config(KUBEFLOW_PS, "evaluator", 0, environment="cloud"),
          PS, "evaluator", 0, False, 3),
    # Kubeflow TFJob, MultiWorkerMirrored (worker replicas only) and chief + workers.
    Valid("kubeflow-mwms-worker0", tf_config(KUBEFLOW_MWMS, "worker", 0, environment="cloud"),
          MWMS, "worker", 0, True, 3),
    Valid("kubeflow-mwms-worker2", tf_config(KUBEFLOW_MWMS, "worker", 2, environment="cloud"),
          MWMS, "worker", 2, False, 3),
    Valid("kubeflow-chief-worker-chief", tf_config(KUBEFLOW_CHIEF_WORKER, "chief", 0, environment="cloud"),
          MWMS, "chief", 0, True, 3),
    Valid("kubeflow-chief-worker-worker0", tf_config(KUBEFLOW_CHIEF_WORKER, "worker", 0, environment="cloud"),
          MWMS, "worker", 0, False, 3),
    # SageMaker PS mode: "master" -> "chief", source "sagemaker", ps at 2223 on every host.
    Valid("sagemaker-ps-master", tf_config(SAGEMAKER_PS_2, "master", 0, environment="cloud"),
          PS, "chief", 0, True, 2, "sagemaker"),
    Valid("sagemaker-ps-ps0", tf_config(SAGEMAKER_PS_2, "ps", 0, environment="cloud"),
          PS, "ps", 0, False, 2, "sagemaker"),
    Valid("sagemaker-ps-ps1", tf_config(SAGEMAKER_PS_2, "ps", 1, environment="cloud"),
          PS, "ps", 1, False, 2, "sagemaker"),
    Valid("sagemaker-ps-worker0", tf_config(SAGEMAKER_PS_2, "worker", 0, environment="cloud"),
          PS, "worker", 0, False, 2, "sagemaker"),
    Valid("sagemaker-ps-3hosts-worker1", tf_config(SAGEMAKER_PS_3, "worker", 1, environment="cloud"),
          PS, "worker", 1, False, 3, "sagemaker"),
    Valid("sagemaker-ps-3hosts-ps2", tf_config(SAGEMAKER_PS_3, "ps", 2, environment="cloud"),
          PS, "ps", 2, False, 3, "sagemaker"),
    Valid("sagemaker-master-worker-no-ps",
          tf_config({"master": ["algo-1:2222"], "worker": ["algo-2:2222"]}, "master", 0, environment="cloud"),
          MWMS, "chief", 0, True, 2, "sagemaker"),
    # SageMaker MWMS mode: worker-only; the SM_* variables say it is SageMaker.
    Valid("sagemaker-mwms-worker0", tf_config(SAGEMAKER_MWMS, "worker", 0), MWMS, "worker", 0, True, 2,
          "sagemaker", SAGEMAKER_ENV),
    Valid("sagemaker-mwms-worker1", tf_config(SAGEMAKER_MWMS, "worker", 1), MWMS, "worker", 1, False, 2,
          "sagemaker", {**SAGEMAKER_ENV, "SM_CURRENT_HOST": "algo-2"}),
    # Google AI Platform: the evaluator is not listed in "cluster"; extra keys in the task and at the top.
    Valid("aiplatform-ps-chief", {"cluster": AI_PLATFORM_PS, "task": {"type": "chief", "index": 0,
                                                                       **AI_PLATFORM_TASK_EXTRA}, **AI_PLATFORM_EXTRA},
          PS, "chief", 0, True, 3),
    Valid("aiplatform-ps-worker1", {"cluster": AI_PLATFORM_PS, "task": {"type": "worker", "index": 1,
                                                                         **AI_PLATFORM_TASK_EXTRA},
                                    **AI_PLATFORM_EXTRA},
          PS, "worker", 1, False, 3),
    Valid("aiplatform-ps-ps0", {"cluster": AI_PLATFORM_PS, "task": {"type": "ps", "index": 0, **AI_PLATFORM_TASK_EXTRA},
                                **AI_PLATFORM_EXTRA},
          PS, "ps", 0, False, 3),
    Valid("aiplatform-ps-evaluator-unlisted", {"cluster": AI_PLATFORM_PS,
                                               "task": {"type": "evaluator", "index": 0, **AI_PLATFORM_TASK_EXTRA},
                                               **AI_PLATFORM_EXTRA},
          PS, "evaluator", 0, False, 3),
    Valid("aiplatform-mwms-evaluator-unlisted", {"cluster": AI_PLATFORM_MWMS,
                                                 "task": {"type": "evaluator", "index": 0},
                                                 **AI_PLATFORM_EXTRA},
          MWMS, "evaluator", 0, False, 2),
    Valid("aiplatform-mwms-worker0", {"cluster": AI_PLATFORM_MWMS, "task": {"type": "worker", "index": 0},
                                      **AI_PLATFORM_EXTRA},
          MWMS, "worker", 0, False, 2),
    # Ray Train: worker-only.
    Valid("ray-worker0", tf_config(RAY, "worker", 0), MWMS, "worker", 0, True, 4),
    Valid("ray-worker3", tf_config(RAY, "worker", 3), MWMS, "worker", 3, False, 4),
    Valid("ray-single-worker", tf_config({"worker": ["10.0.0.11:41001"]}, "worker", 0), MWMS, "worker", 0, True, 1),
    # spark-tensorflow-distributor: every barrier task a worker, ephemeral ports, no chief.
    Valid("spark-distributor-worker0", tf_config(SPARK_DISTRIBUTOR, "worker", 0), MWMS, "worker", 0, True, 3),
    Valid("spark-distributor-worker2", tf_config(SPARK_DISTRIBUTOR, "worker", 2), MWMS, "worker", 2, False, 3),
    # stratkit's own launchers.
    Valid("stratkit-spark-runner", tf_config(SPARK_DISTRIBUTOR, "worker", 1), MWMS, "worker", 1, False, 3,
          "spark", {"STRATKIT_LAUNCHER": "spark"}),
    Valid("stratkit-launch-mwms", tf_config(LAUNCH_MWMS, "worker", 0), MWMS, "worker", 0, True, 2,
          "launch", {"STRATKIT_LAUNCHER": "launch"}),
    Valid("stratkit-launch-ps-chief", tf_config(LAUNCH_PS, "chief", 0), PS, "chief", 0, True, 3,
          "launch", {"STRATKIT_LAUNCHER": "launch"}),
    Valid("stratkit-launch-ps-ps0", tf_config(LAUNCH_PS, "ps", 0), PS, "ps", 0, False, 3,
          "launch", {"STRATKIT_LAUNCHER": "launch"}),
    # IPv6 literals in brackets.
    Valid("ipv6-loopback", tf_config({"worker": ["[::1]:2222", "[::1]:2223"]}, "worker", 1),
          MWMS, "worker", 1, False, 2),
    Valid("ipv6-global", tf_config({"chief": ["[2001:db8::1]:2222"], "worker": ["[2001:db8::2]:2222"]}, "chief", 0),
          MWMS, "chief", 0, True, 2),
    Valid("ipv6-v4-mapped", tf_config({"worker": ["[::ffff:10.0.0.1]:2222"]}, "worker", 0), MWMS, "worker", 0, True, 1),
    # Small and edge-shaped clusters.
    Valid("one-worker-cluster", tf_config({"worker": ["localhost:12345"]}, "worker", 0), MWMS, "worker", 0, True, 1),
    Valid("chief-only-cluster", tf_config({"chief": ["localhost:12345"]}, "chief", 0), MWMS, "chief", 0, True, 1),
    Valid("chief-and-listed-evaluator", tf_config({"chief": ["a:1"], "evaluator": ["b:1"]}, "evaluator", 0),
          MWMS, "evaluator", 0, False, 1),
    Valid("workers-and-listed-evaluator-worker0",
          tf_config({"worker": ["a:1", "b:1"], "evaluator": ["c:1"]}, "worker", 0), MWMS, "worker", 0, True, 2),
    Valid("worker-only-evaluator-unlisted", tf_config({"worker": ["a:1", "b:1"]}, "evaluator", 0),
          MWMS, "evaluator", 0, False, 2),
    Valid("big-ps-ps2", tf_config(BIG_PS, "ps", 2), PS, "ps", 2, False, 5),
    Valid("big-ps-worker3", tf_config(BIG_PS, "worker", 3), PS, "worker", 3, False, 5),
    Valid("big-ps-evaluator-listed", tf_config(BIG_PS, "evaluator", 0), PS, "evaluator", 0, False, 5),
    Valid("sixteen-workers-last", tf_config(SIXTEEN, "worker", 15), MWMS, "worker", 15, False, 16),
    Valid("ports-1-and-65535", tf_config({"worker": ["a:1", "b:65535"]}, "worker", 1), MWMS, "worker", 1, False, 2),
    Valid("same-host-many-ports", tf_config({"chief": ["localhost:5000"], "worker": ["localhost:5001"],
                                             "ps": ["localhost:5002"]}, "worker", 0),
          PS, "worker", 0, False, 2),
    Valid("ps-listed-first", tf_config({"ps": ["p:1"], "worker": ["w:1"], "chief": ["c:1"]}, "chief", 0),
          PS, "chief", 0, True, 2),
    Valid("unknown-top-level-keys", tf_config({"worker": ["a:1", "b:1"]}, "worker", 1, environment="cloud",
                                              rpc_layer="grpc", session_master="", foo={"bar": [1, 2]}),
          MWMS, "worker", 1, False, 2),
    Valid("underscores-and-upper-case-hosts", tf_config({"worker": ["GPU_Node-1.LOCAL:2222", "gpu_node-2:2222"]},
                                                        "worker", 0),
          MWMS, "worker", 0, True, 2),
    Valid("pretty-printed-json", PRETTY, MWMS, "worker", 1, False, 3),
    Valid("ipv4-addresses", tf_config({"chief": ["192.168.1.10:2222"], "worker": ["192.168.1.11:2222"],
                                       "ps": ["192.168.1.12:2222"]}, "ps", 0),
          PS, "ps", 0, False, 2),
]

assert len({case.id for case in VALID}) == len(VALID)


def _cluster_of(case: Valid) -> dict[str, list[str]]:
    """The expected cluster: the TF_CONFIG's, with SageMaker's "master" read as "chief"."""
    raw = json.loads(case.text())["cluster"]
    return {("chief" if role == "master" else role): list(addresses) for role, addresses in raw.items()}


def test_table_is_big_enough() -> None:
    assert len(VALID) >= 40
    assert len(INVALID) >= 25


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_valid_tf_config(case: Valid) -> None:
    spec = stratkit.detect(case.environ())

    assert isinstance(spec, stratkit.ClusterSpec)
    assert (spec.strategy, spec.task_type, spec.task_index, spec.is_chief, spec.num_workers, spec.source) == (
        case.strategy, case.task_type, case.task_index, case.is_chief, case.num_workers, case.source)
    assert spec.cluster == _cluster_of(case)
    assert spec.is_multi_host


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_valid_tf_config_round_trips(case: Valid) -> None:
    """to_tf_config() is a TF_CONFIG that describes the same task in the same cluster."""
    spec = stratkit.detect(case.environ())
    text = spec.to_tf_config()
    config = json.loads(text)
    assert "master" not in config["cluster"], "TensorFlow rejects the role name 'master'"
    again = stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": text})
    fields = ("strategy", "task_type", "task_index", "cluster", "is_chief", "num_workers")
    assert {f: getattr(again, f) for f in fields} == {f: getattr(spec, f) for f in fields}


# ---------------------------------------------------------------------------------------------
# Invalid TF_CONFIG: ConfigError naming TF_CONFIG, the offending value and the fix.


@dataclass(frozen=True)
class Invalid:
    id: str
    tf_config: Any  # dict/list (dumped to JSON) or the raw string
    shows: tuple[str, ...]  # parts of the offending value the message must quote

    def text(self) -> str:
        return self.tf_config if isinstance(self.tf_config, str) else json.dumps(self.tf_config)


W2 = {"worker": ["a:2222", "b:2222"]}
TASK_W0 = {"type": "worker", "index": 0}

INVALID = [
    # Not JSON / not an object.
    Invalid("not-json", "worker:0", ("worker:0", "not valid JSON")),
    Invalid("truncated-json", '{"cluster": {"worker": ["a:1"]', ('{"cluster": {"worker": ["a:1"]',)),
    Invalid("python-repr-single-quotes", "{'cluster': {'worker': ['a:1']}}", ("{'cluster'",)),
    Invalid("json-list", ["a:1", "b:1"], ('["a:1", "b:1"]', "object")),
    Invalid("json-string", '"worker"', ("worker", "object")),
    Invalid("json-null", "null", ("null", "object")),
    Invalid("json-number", "2222", ("2222", "object")),
    Invalid("deeply-nested-json", "[" * 5000 + "]" * 5000, ("[[[[[[[[",)),
    # "cluster" shape.
    Invalid("cluster-is-a-list", {"cluster": ["a:1"], "task": TASK_W0}, ('["a:1"]', '"cluster"')),
    Invalid("role-value-is-a-string", {"cluster": {"worker": "a:2222"}, "task": TASK_W0}, ("a:2222", "list")),
    Invalid("role-value-has-a-number", {"cluster": {"worker": [2222]}, "task": TASK_W0}, ("[2222]",)),
    Invalid("empty-role-list", {"cluster": {"worker": ["a:1"], "ps": []}, "task": TASK_W0}, ("[]", '"ps"')),
    Invalid("unknown-role", {"cluster": {"worker": ["a:1"], "trainer": ["b:1"]}, "task": TASK_W0}, ("trainer",)),
    Invalid("role-with-wrong-case", {"cluster": {"Worker": ["a:1"]}, "task": TASK_W0}, ("Worker",)),
    Invalid("two-chiefs", {"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}, "task": TASK_W0},
            ('"a:1", "b:1"', "chief")),
    Invalid("master-and-chief", {"cluster": {"master": ["a:1"], "chief": ["b:1"], "worker": ["c:1"]},
                                 "task": TASK_W0}, ("master", "chief")),
    Invalid("two-evaluators", {"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "e:2"]}, "task": TASK_W0},
            ('"e:1", "e:2"', "evaluator")),
    Invalid("no-training-role", {"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}},
            ("evaluator",)),
    # Addresses.
    Invalid("address-without-port", {"cluster": {"worker": ["host1", "host2:2222"]}, "task": TASK_W0},
            ("host1", "port")),
    Invalid("address-with-scheme", {"cluster": {"worker": ["grpc://host1:2222"]}, "task": TASK_W0},
            ("grpc://host1:2222",)),
    Invalid("address-with-space", {"cluster": {"worker": [" host1:2222"]}, "task": TASK_W0}, ("host1:2222",)),
    Invalid("ipv6-without-brackets", {"cluster": {"worker": ["::1:2222"]}, "task": TASK_W0}, ("::1:2222",)),
    Invalid("port-zero", {"cluster": {"worker": ["host1:0"]}, "task": TASK_W0}, ("host1:0", "1..65535")),
    Invalid("port-too-big", {"cluster": {"worker": ["host1:65536"]}, "task": TASK_W0}, ("host1:65536", "1..65535")),
    Invalid("port-negative", {"cluster": {"worker": ["host1:-1"]}, "task": TASK_W0}, ("host1:-1",)),
    Invalid("port-not-a-number", {"cluster": {"worker": ["host1:http"]}, "task": TASK_W0}, ("host1:http",)),
    Invalid("port-empty", {"cluster": {"worker": ["host1:"]}, "task": TASK_W0}, ("host1:",)),
    Invalid("port-superscript-digit", {"cluster": {"worker": ["host1:2²"]}, "task": TASK_W0}, ("host1:2²",)),
    Invalid("port-arabic-indic-digits", {"cluster": {"worker": ["host1:٢٢٢٢"]}, "task": TASK_W0},
            ("host1:٢٢٢٢",)),
    Invalid("address-duplicated-across-roles",
            {"cluster": {"chief": ["a:2222"], "worker": ["a:2222", "b:2222"]}, "task": TASK_W0},
            ("a:2222", "chief[0]", "worker[0]")),
    Invalid("address-duplicated-in-role", {"cluster": {"worker": ["a:2222", "a:2222"]}, "task": TASK_W0},
            ("a:2222", "worker[0]", "worker[1]")),
    # Parameter-server layouts that cannot train.
    Invalid("ps-without-worker", {"cluster": {"chief": ["c:1"], "ps": ["p:1"]}, "task": {"type": "chief", "index": 0}},
            ('"ps"', "worker")),
    Invalid("ps-without-chief", {"cluster": {"worker": ["w:1"], "ps": ["p:1"]}, "task": TASK_W0},
            ('"ps"', "chief")),
    # "task".
    Invalid("missing-task", {"cluster": W2}, ('"a:2222"', '"task"')),
    Invalid("task-without-cluster", {"task": TASK_W0, "environment": "cloud"}, ('"task"', '"worker"')),
    Invalid("task-is-a-string", {"cluster": W2, "task": "worker:0"}, ("worker:0",)),
    Invalid("task-is-a-list", {"cluster": W2, "task": ["worker", 0]}, ('["worker", 0]',)),
    Invalid("task-type-missing", {"cluster": W2, "task": {"index": 0}}, ('{"index": 0}', "task.type")),
    Invalid("task-type-not-a-string", {"cluster": W2, "task": {"type": 1, "index": 0}}, ('"type": 1',)),
    Invalid("task-type-empty", {"cluster": W2, "task": {"type": "", "index": 0}}, ('"type": ""',)),
    Invalid("task-type-unknown", {"cluster": W2, "task": {"type": "trainer", "index": 0}}, ("trainer",)),
    Invalid("task-type-absent-from-cluster", {"cluster": W2, "task": {"type": "chief", "index": 0}},
            ('"chief"', "cluster")),
    Invalid("task-type-ps-absent-from-cluster", {"cluster": W2, "task": {"type": "ps", "index": 0}}, ('"ps"',)),
    Invalid("task-index-missing", {"cluster": W2, "task": {"type": "worker"}}, ('{"type": "worker"}', "task.index")),
    Invalid("task-index-out-of-range", {"cluster": W2, "task": {"type": "worker", "index": 2}},
            ('"index": 2', "out of range")),
    Invalid("task-index-negative", {"cluster": W2, "task": {"type": "worker", "index": -1}}, ('"index": -1',)),
    Invalid("task-index-bool", {"cluster": W2, "task": {"type": "worker", "index": True}}, ('"index": true',)),
    Invalid("task-index-float", {"cluster": W2, "task": {"type": "worker", "index": 0.0}}, ('"index": 0.0',)),
    Invalid("task-index-string", {"cluster": W2, "task": {"type": "worker", "index": "0"}}, ('"index": "0"',)),
    Invalid("task-index-null", {"cluster": W2, "task": {"type": "worker", "index": None}}, ('"index": null',)),
    Invalid("evaluator-unlisted-index-1", {"cluster": W2, "task": {"type": "evaluator", "index": 1}},
            ('"index": 1', "evaluator")),
    Invalid("evaluator-listed-index-1", {"cluster": {**W2, "evaluator": ["e:1"]},
                                         "task": {"type": "evaluator", "index": 1}}, ('"index": 1',)),
]

assert len({case.id for case in INVALID}) == len(INVALID)


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_tf_config(case: Invalid) -> None:
    with pytest.raises(ConfigError) as raised:
        stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": case.text()})
    message = str(raised.value)
    assert isinstance(raised.value, ValueError)
    assert "TF_CONFIG" in message
    assert "Fix" in message
    for part in case.shows:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.id)
def test_invalid_tf_config_is_ignored_when_detection_is_off(case: Invalid) -> None:
    """STRATKIT_CLUSTER_ENV=none never reads TF_CONFIG, however broken it is."""
    spec = stratkit.detect({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": case.text(), "STRATKIT_CLUSTER_ENV": "none"})
    assert (spec.strategy, spec.cluster, spec.source) == ("one_device", {}, "local")


# ---------------------------------------------------------------------------------------------
# Differential: every valid row against TensorFlow's own reading of the same TF_CONFIG.


@pytest.fixture(scope="module")
def tf_distribute():
    """(TFConfigClusterResolver, multi_worker_util.is_chief); imports TensorFlow only here."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
        tf = pytest.importorskip("tensorflow")
    from tensorflow.python.distribute import multi_worker_util

    return tf.distribute.cluster_resolver.TFConfigClusterResolver, multi_worker_util.is_chief


def _dense(cluster: dict) -> dict[str, list[str]]:
    """TF's ClusterSpec.as_dict() gives {index: address} for a sparse job; make every job a list."""
    dense = {}
    for role, tasks in cluster.items():
        if isinstance(tasks, dict):
            assert sorted(tasks) == list(range(len(tasks))), f"job {role!r} has gaps: {tasks}"
            tasks = [tasks[i] for i in range(len(tasks))]
        dense[role] = list(tasks)
    return dense


@pytest.mark.slow
@pytest.mark.parametrize("case", VALID, ids=lambda c: c.id)
def test_matches_tensorflow(case: Valid, tf_distribute, monkeypatch: pytest.MonkeyPatch) -> None:
    resolver_class, tf_is_chief = tf_distribute
    spec = stratkit.detect(case.environ())

    if "master" in json.loads(case.text())["cluster"]:
        # SageMaker's "master" is not a role TensorFlow trains with (multi_worker_util rejects it),
        # so TF is given what stratkit hands it: the spec's own TF_CONFIG, with "master" -> "chief".
        fed = spec.to_tf_config()
    else:
        fed = case.text()
    monkeypatch.setenv("TF_CONFIG", fed)
    resolver = resolver_class()

    assert resolver.task_type == spec.task_type
    assert resolver.task_id == spec.task_index
    assert _dense(resolver.cluster_spec().as_dict()) == spec.cluster

    tf_chief = tf_is_chief(resolver.cluster_spec(), resolver.task_type, resolver.task_id)
    if spec.task_type == "evaluator":
        # TensorFlow calls the evaluator "a chief job on its own" (it is outside the training
        # cluster). stratkit deliberately does not: is_chief decides who saves the trained model,
        # writes the logs and coordinates, and the evaluator must never do that.
        assert tf_chief is True
        assert spec.is_chief is False
    else:
        assert spec.is_chief == tf_chief
