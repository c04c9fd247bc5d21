"""Keep the machine's own environment out of the cluster-detection tests.

Every test in tests/cluster starts from an os.environ without the variables
`stratkit.detect()` reads, so a developer's TF_CONFIG, a CI runner's Slurm
allocation or a Colab TPU cannot change a result. Tests that read os.environ
set what they need with `monkeypatch`; most pass an explicit `environ=` dict.
"""

from __future__ import annotations

import os

import pytest

_PREFIXES = ("STRATKIT_", "SLURM_", "TPU_", "SM_", "COLAB_TPU", "KUBE_GOOGLE_CLOUD_TPU")
_NAMES = ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def _clean_cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name in _NAMES or name.startswith(_PREFIXES):
            monkeypatch.delenv(name, raising=False)
