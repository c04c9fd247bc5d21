"""The training process of one `RayRunner` task: `python -m stratkit.ray.child WORKDIR`.

Started by the task's actor (`stratkit.ray.task`) with
`stratkit.process.children.start_child`, so it runs in its own process group
and dies with the actor. Its environment (TF_CONFIG, STRATKIT_LAUNCHER=ray,
CUDA_VISIBLE_DEVICES) was fixed before it started, so TensorFlow reads them
when its context starts. Why a fresh process per task and run: TensorFlow
configures collectives and devices once per process, so an actor's own Python
(or a reused one) could not train twice.
"""

from __future__ import annotations

import os
import sys

from stratkit.process.payload import exit_now, load_payload, run_function

#: "1" on the task whose return value run() returns (the chief).
RESULT_VAR = "STRATKIT_RAY_RETURNS"
_FIX = ("define train_fn in the driver script or notebook (pickled by value), or install the module it lives in "
        "on every Ray node (the Python Ray runs there)")


def main(argv: list[str]) -> int:
    workdir = argv[1]

    def call():
        fn, args, kwargs = load_payload(workdir, _FIX)
        return fn(*args, **kwargs)

    return exit_now(run_function(call, workdir, keep_result=os.environ.get(RESULT_VAR) == "1"))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
