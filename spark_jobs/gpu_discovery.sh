#!/usr/bin/env bash
# A Spark GPU discovery script that reports FAKE GPUs, for tests and dry runs on machines without GPUs.
#
# Spark runs it on each worker/executor (spark.worker.resource.gpu.discoveryScript,
# spark.executor.resource.gpu.discoveryScript, spark.driver.resource.gpu.discoveryScript) and
# schedules the addresses it prints. TensorFlow cannot use these GPUs: on a CPU machine training
# still runs on the CPU. On real GPU nodes use Spark's own example instead, which asks nvidia-smi:
#   $SPARK_HOME/examples/src/main/scripts/getGpusResources.sh
#
# STRATKIT_FAKE_GPUS: comma-separated addresses to report (default 0,1,2,3).
set -euo pipefail
addresses="${STRATKIT_FAKE_GPUS:-0,1,2,3}"
quoted=$(printf '%s' "$addresses" | sed 's/[^,][^,]*/"&"/g')
printf '{"name": "gpu", "addresses": [%s]}\n' "$quoted"
