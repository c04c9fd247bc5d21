"""The Spark confs a run reads, and the choices they decide (stage kind, SSL, GPUs per task, standby).

Driver side only. On a classic SparkSession the startup confs come from the
SparkContext; on Spark Connect (no SparkContext) from the session; stratkit's
own keys are read from the session's runtime confs in both cases, so
`spark.conf.set("spark.stratkit.standby", "false")` works between runs.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from stratkit import status
from stratkit.errors import ConfigError
from stratkit.spark import slots, staging

log = status.logger("stratkit.spark.runner")

#: Conf choosing the barrier stage: "auto" (an RDD barrier stage where there is a SparkContext, measured
#: ~1.6 s to set up against ~5 s for mapInArrow; mapInArrow on Spark Connect), "arrow" or "rdd".
STAGE_CONF = "spark.stratkit.stage"
#: Conf: keep one warm standby training process per Spark Python worker ("true", the default) or not.
STANDBY_CONF = "spark.stratkit.standby"
#: Confs that let training run on a cluster with spark.ssl.enabled (TensorFlow's gRPC is not encrypted).
IGNORE_SSL_CONFS = ("spark.stratkit.ignoreSsl", "tensorflow.spark.distributor.ignoreSsl")


def spark_context(spark: Any) -> Any:
    """The SparkContext, or None on Spark Connect (where only the DataFrame API exists)."""
    try:
        return spark.sparkContext
    except Exception:  # noqa: BLE001 - Connect raises on sparkContext access
        return None


def read_confs(spark: Any, sc: Any) -> dict[str, str]:
    """Startup confs (SparkConf) overlaid with the session's runtime confs for stratkit's own keys."""
    confs: dict[str, str] = {}
    if sc is not None:
        confs.update(dict(sc.getConf().getAll()))
    else:
        try:
            confs.update(dict(spark.conf.getAll))
        except Exception as exc:  # noqa: BLE001 - older Connect clients
            log.debug("cannot list the session's confs: %s", exc)
    for key in (STAGE_CONF, STANDBY_CONF, staging.STAGING_CONF, slots.WAIT_CONF, *IGNORE_SSL_CONFS):
        try:
            value = spark.conf.get(key, None)
        except Exception:  # noqa: BLE001
            value = None
        if value is not None:
            confs[key] = value
    if "spark.master" not in confs:
        try:
            confs["spark.master"] = spark.conf.get("spark.master", "")
        except Exception:  # noqa: BLE001
            confs["spark.master"] = ""
    return confs


def conf_bool(confs: dict[str, str], key: str, default: str = "false") -> bool:
    value = str(confs.get(key, default)).strip().lower()
    if value not in ("true", "false"):
        raise ConfigError(f"Spark conf {key}={confs[key]!r} must be true or false. Fix: set it to true or false")
    return value == "true"


def check_ssl(confs: dict[str, str], name: str, logger: logging.Logger = log) -> None:
    """Refuse to send model and data unencrypted on a cluster that asked for encryption."""
    if not conf_bool(confs, "spark.ssl.enabled"):
        return
    if any(conf_bool(confs, key) for key in IGNORE_SSL_CONFS):
        logger.warning("spark.ssl.enabled is true, but %s sends model parameters and data between tasks over "
                    "TensorFlow's unencrypted gRPC, as %s allows", name,
                    " / ".join(k for k in IGNORE_SSL_CONFS if conf_bool(confs, k)))
        return
    raise ConfigError(f"this cluster has TLS encryption enabled (spark.ssl.enabled=true), but {name} sends model "
                      "parameters and possibly training data between tasks unencrypted (TensorFlow's gRPC). "
                      f"Fix: to run anyway, set {IGNORE_SSL_CONFS[0]}=true (or {IGNORE_SSL_CONFS[1]}=true) in the "
                      "Spark configuration")


def task_gpu_amount(confs: dict[str, str], key: str) -> int:
    if key not in confs:
        raise ConfigError(f"use_gpu=True but the Spark conf {key} is not set, so Spark does not schedule GPUs to "
                          f"tasks. Fix: set {key} (GPUs per task), spark.executor.resource.gpu.amount and a GPU "
                          "discovery script (see spark_jobs/train_digits_gpu.py), or pass use_gpu=False")
    try:
        amount = float(confs[key])
    except ValueError:
        raise ConfigError(f"Spark conf {key}={confs[key]!r} is not a number. Fix: e.g. {key}=1") from None
    if amount < 1 or amount != int(amount):
        raise ConfigError(f"Spark conf {key}={confs[key]} must be a whole number >= 1 for training (a TensorFlow "
                          f"task cannot share a GPU safely). Fix: set {key}=1 or more")
    return int(amount)


def arrow_stage_available(spark: Any) -> bool:
    """mapInArrow(barrier=True) needs pyspark >= 3.5, and pyspark needs pandas and pyarrow on the driver."""
    try:
        from pyspark.sql import DataFrame

        if "barrier" not in inspect.signature(DataFrame.mapInArrow).parameters:
            return False
        import pandas  # noqa: F401 - pyspark refuses mapInArrow without it
        import pyarrow  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def choose_stage(confs: dict[str, str], sc: Any) -> str:
    choice = str(confs.get(STAGE_CONF, "auto")).strip().lower()
    if choice not in ("auto", "arrow", "rdd"):
        raise ConfigError(f"Spark conf {STAGE_CONF}={confs[STAGE_CONF]!r} is not known. Fix: use auto, arrow or rdd")
    arrow = arrow_stage_available(None)
    if choice == "arrow" and not arrow:
        raise ConfigError(f"{STAGE_CONF}=arrow needs DataFrame.mapInArrow(barrier=True) (pyspark >= 3.5) with pandas "
                          "and pyarrow installed. Fix: pip install 'pyspark[sql]>=3.5', or set it to rdd")
    if choice == "rdd" and sc is None:
        raise ConfigError(f"{STAGE_CONF}=rdd needs a SparkContext, which Spark Connect does not have. "
                          "Fix: set it to auto or arrow")
    if choice == "auto":
        choice = "rdd" if sc is not None else "arrow"
    return "mapInArrow" if choice == "arrow" else "rdd"
