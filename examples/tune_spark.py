"""The same KerasTuner search on Spark: each tuner an ordinary Spark task, the search service on the driver.

    python examples/tune_spark.py                        # 2 tuners on a local Spark (local[2])
    spark-submit --master yarn examples/tune_spark.py --tuners 8 --store s3://bucket/search

`SparkRunner(num_workers=N, tune=True)` runs N tuners, one per free executor slot (one per GPU with
spark.task.resource.gpu.amount and use_gpu=True): a search takes the slots it finds, where one barrier stage
would wait for all of them. A tuner lost with its executor is a lease that expires: its trial runs again on
another tuner (docs/tuning.md). The search function is examples/tune_keras_tuner.py's, unchanged.
"""

import argparse
import json
import os
import sys

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_keras_tuner  # noqa: E402 - the search itself, beside this file

from stratkit.spark import SparkRunner  # noqa: E402

cloudpickle.register_pickle_by_value(tune_keras_tuner)  # the executors get it with the function, by value


def search_on_spark(spark, tuners=2, trials=8, epochs=3, store=None):
    """The example's search on `tuners` Spark tasks; the lowest tuner's result (every tuner has the same)."""
    runner = SparkRunner(num_workers=tuners, tune=True, spark=spark)
    return runner.run(tune_keras_tuner.search, trials, epochs, store)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tuners", type=int, default=2)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--store", default=None, help="a store URL every executor reaches (default: a directory "
                        "here, which only a local Spark's executors share)")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # executors run this Python, which has stratkit
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master(os.environ.get("SPARK_MASTER", f"local[{args.tuners}]")).getOrCreate()
    store = args.store or os.path.abspath("tuning-spark-store")
    result = search_on_spark(spark, args.tuners, args.trials, args.epochs, store)
    print(json.dumps(result, sort_keys=True), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
