"""The training process of one `LocalRunner` task: `python -m stratkit.launch.runfn WORKDIR`.

Started by `stratkit launch`'s machinery (`launch/attempt.py`, one per task, with
its TF_CONFIG), it does what the Spark and Ray tasks' processes do
(`stratkit.process.payload`): load the cloudpickled `(train_fn, args, kwargs)`
from WORKDIR, call it, and on the chief (the task `stratkit.detect()` names
chief: worker 0, or the chief of a parameter-server cluster) write its return
value to WORKDIR/result.pkl for the runner; then leave without TensorFlow's
slow teardown. Every task shares WORKDIR: only the chief writes in it. In a
tune run (`LocalRunner(tune=True)`) every task is a tuner and writes its own
`result-<tuner>.pkl`: the runner returns the lowest tuner's (a tuner may die).
"""

from __future__ import annotations

import sys

from stratkit.process.payload import TUNER_RESULT, exit_now, load_payload, run_function
from stratkit.tuning import environment

_FIX = ("define train_fn in the script or notebook that calls LocalRunner.run (it is pickled by value), or in a "
        "module this Python can import")


def main(argv: list[str]) -> int:
    workdir = argv[1]
    from stratkit.cluster import detect

    def call():
        fn, args, kwargs = load_payload(workdir, _FIX)
        return fn(*args, **kwargs)

    tune = environment.from_environ()
    if tune is not None:
        return exit_now(run_function(call, workdir, keep_result=True, result_name=TUNER_RESULT.format(tune.tuner)))
    return exit_now(run_function(call, workdir, keep_result=detect().is_chief))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
