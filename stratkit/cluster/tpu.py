"""TPU environments: Cloud TPU (TPU_NAME), GKE, Colab, and TPU VMs."""

from __future__ import annotations

from typing import Mapping

# Checked in this order; the first one set names the TPU. On a TPU VM the TPU
# is attached to the host, which TensorFlow's resolver calls "local".
_TPU_VARS = (
    ("TPU_NAME", lambda v: v),
    ("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", lambda v: v),
    ("COLAB_TPU_ADDR", lambda v: v if "://" in v else f"grpc://{v}"),
    ("TPU_ACCELERATOR_TYPE", lambda v: "local"),
    ("TPU_WORKER_ID", lambda v: "local"),
)


def detect_tpu(env: Mapping[str, str]) -> tuple[str, str] | None:
    """Return (variable, TPU name for TPUClusterResolver) or None when no TPU environment is set."""
    for var, to_name in _TPU_VARS:
        value = env.get(var, "").strip()
        if value:
            return var, to_name(value)
    return None
