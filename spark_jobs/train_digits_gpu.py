"""Train the digits model on Spark executors with the GPUs Spark schedules (SparkRunner(use_gpu=True)).

Each barrier task gets the GPUs Spark assigned to it (its task resources) as
CUDA_VISIBLE_DEVICES -- remapped through a CUDA_VISIBLE_DEVICES the executor
already has -- and trains as one MultiWorkerMirroredStrategy worker (one
replica per GPU). Spark must be told the executors have GPUs; the confs are
the same everywhere, only where they go differs:

    spark.executor.resource.gpu.amount=1            GPUs per executor
    spark.task.resource.gpu.amount=1                GPUs per task (= per TF worker)
    spark.executor.resource.gpu.discoveryScript=... prints {"name": "gpu", "addresses": ["0", ...]}
    (Spark ships one: $SPARK_HOME/examples/src/main/scripts/getGpusResources.sh, which asks nvidia-smi)

Standalone (the worker owns the GPUs and hands them to executors):
    # on every worker host, in conf/spark-defaults.conf or SPARK_WORKER_OPTS:
    spark.worker.resource.gpu.amount 4
    spark.worker.resource.gpu.discoveryScript /opt/spark/examples/src/main/scripts/getGpusResources.sh
    spark-submit --master spark://master:7077 \\
        --conf spark.executor.resource.gpu.amount=1 --conf spark.task.resource.gpu.amount=1 \\
        --conf spark.pyspark.python=/opt/venv/bin/python spark_jobs/train_digits_gpu.py --workers 2

YARN (GPU scheduling enabled in YARN, Hadoop 3.1+; YARN isolates the devices):
    spark-submit --master yarn --deploy-mode client --num-executors 2 --executor-cores 1 \\
        --conf spark.executor.resource.gpu.amount=1 --conf spark.task.resource.gpu.amount=1 \\
        --conf spark.executor.resource.gpu.discoveryScript=./getGpusResources.sh \\
        --files $SPARK_HOME/examples/src/main/scripts/getGpusResources.sh \\
        --conf spark.pyspark.python=./venv/bin/python --archives venv.tar.gz#venv \\
        spark_jobs/train_digits_gpu.py --workers 2

Kubernetes (the device plugin's vendor name requests the GPU for the pod):
    spark-submit --master k8s://https://<api-server>:6443 --deploy-mode cluster \\
        --conf spark.kubernetes.container.image=<image with stratkit + CUDA TensorFlow> \\
        --conf spark.executor.instances=2 --conf spark.executor.cores=1 \\
        --conf spark.executor.resource.gpu.amount=1 --conf spark.executor.resource.gpu.vendor=nvidia.com \\
        --conf spark.executor.resource.gpu.discoveryScript=/opt/spark/examples/src/main/scripts/getGpusResources.sh \\
        --conf spark.task.resource.gpu.amount=1 \\
        local:///opt/app/spark_jobs/train_digits_gpu.py --workers 2

Dry run on a machine without GPUs (FAKE GPU addresses from spark_jobs/gpu_discovery.sh: Spark's
scheduling is real, TensorFlow finds no GPU and trains on the CPU; the JSON line says so):
    SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/spark-submit \\
        --master "local-cluster[2,1,2048]" \\
        --conf spark.worker.resource.gpu.amount=1 \\
        --conf spark.worker.resource.gpu.discoveryScript=$PWD/spark_jobs/gpu_discovery.sh \\
        --conf spark.executor.resource.gpu.amount=1 --conf spark.task.resource.gpu.amount=1 \\
        spark_jobs/train_digits_gpu.py
"""

from __future__ import annotations

import os
import sys

import cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_digits

# Ship train_digits' functions by value, so executors need no copy of this directory.
cloudpickle.register_pickle_by_value(train_digits)

if __name__ == "__main__":
    train_digits.main(use_gpu=True)
