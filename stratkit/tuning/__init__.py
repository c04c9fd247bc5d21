"""Hyperparameter search across a cluster: N tuners, one search, no hang when one dies.

    import keras_tuner, stratkit
    tuner = stratkit.tune(keras_tuner.RandomSearch(build_model, objective="val_loss", max_trials=8, seed=1))
    tuner.search(x, y, epochs=5, validation_data=(xv, yv))
    model = tuner.get_best_models()[0]

    import optuna, stratkit
    study = stratkit.tune(optuna.create_study(pruner=optuna.pruners.MedianPruner()))
    study.optimize(objective, n_trials=8)          # the study's 8 trials, on every worker together

The same script runs as one process (`python search.py`), as N tuners under
`stratkit launch --tune --workers N -- python search.py` (each K workers one
tuner with `--workers-per-trial K`), as an srun step's tasks, and inside
`stratkit.LocalRunner` / `SparkRunner` / `RayRunner(num_workers=N,
tune=True).run(fn)`: with a seed, every way tries the same trials and gets the
same scores (docs/tuning.md).

One job per module:

| module | job |
|---|---|
| `environment` | the variables an engine hands each tuner (address, token, tuner id, count, host or not) |
| `service` | the search service: the start gate, trials as leases, the order, the end, the stored state |
| `leases` | the lease table: hand-out, heartbeats, expiry, a lost trial's re-run, giving up |
| `planner` | what a tuner library brings (`Planner`), per-trial seeds (`trial_seed`) |
| `protocol` | the wire format over `AuthListener`, and a tuner's connection (reconnecting, bounded) |
| `client` | a tuner's requests, its leases' heartbeat thread |
| `search_store` | the search's layout on a store URL or directory (state, trial files per run, backups) |
| `session` | what this process is (alone, host, tuner, a group's follower), its service and client |
| `hub` | the run's listener: one port for every search of a run, each request to its search |
| `driver` | the searches hosted on an engine's driver (Spark, Ray): the hub, the tuners' variables, their ends |
| `slurm` | an srun step's tasks as tuners: task 0 hosts, the address from the step, the user's token |
| `groups` | a multi-worker trial group: its chief talks to the service, the others follow it |
| `tracking` / `tracked` | MLflow: a parent run per search, a child per trial / the planner wrapper that feeds them |
| `kt_oracle` / `kt_tuner` | KerasTuner: its oracle as a planner / a user's tuner on the service |
| `optuna_planner` / `optuna_study` | Optuna: the study on the service as a planner / a user's study on the service |
| `optuna_storage` / `optuna_codec` | Optuna: a worker's storage, sampler, pruner on the service / the study as JSON |
| `devices` | the devices a trial trains on (this tuner's own) |

How a tuner library plugs in: a `planner.Planner` over its algorithm, an
adapter that runs the service's leases (`session.open_session`), and an entry
in `ADAPTERS` so `tune(obj)` finds it (see `planner`'s docstring). How an
engine plugs in: start one process per tuner with `environment.task_env(...)`
(and no TF_CONFIG), host the searches itself (`driver.DriverSearch`, on
`hub.SearchHub(create=...)` as `LocalRunner` does) or let its first task host
them (`serve=True`, as `stratkit launch --tune` does), and treat a dead tuner as
a lease that expires, not as the run's failure (see `environment`).

Imports no TensorFlow until a tuner is passed in.
"""

from __future__ import annotations

import importlib
from typing import Any

from stratkit.errors import ConfigError
from stratkit.tuning.protocol import SearchFailed, SearchUnreachable

#: (the package a tuner object's class comes from, the adapter module, its function): `tune` picks by the first.
ADAPTERS: tuple[tuple[str, str, str], ...] = (
    ("keras_tuner", "stratkit.tuning.kt_tuner", "distribute"),
    ("optuna", "stratkit.tuning.optuna_study", "distribute"),
)


def _library(obj: Any) -> str | None:
    for cls in type(obj).__mro__:
        root = (cls.__module__ or "").split(".")[0]
        if any(root == package for package, _, _ in ADAPTERS):
            return root
    return None


def tune(obj: Any, **options: Any) -> Any:
    """Make a tuner library's object one tuner of stratkit's distributed search; returns the same object.

    KerasTuner: `stratkit.tune(keras_tuner.Hyperband(...), store=None, exact=True, backups=True,
    lease_seconds=None, tracking="auto")`, see `stratkit.tuning.kt_tuner.distribute`.
    Optuna: `stratkit.tune(optuna.create_study(...), store=None, seed=0, lease_seconds=None, retries=2)`, then
    `study.optimize(objective, n_trials=...)` (the study's trials across every worker), see
    `stratkit.tuning.optuna_study.distribute`.

    Raises:
        ConfigError: `obj` is not from a supported library, or the search cannot start (naming why).
    """
    library = _library(obj)
    for package, module, function in ADAPTERS:
        if package == library:
            return getattr(importlib.import_module(module), function)(obj, **options)
    supported = ", ".join(package for package, _, _ in ADAPTERS)
    raise ConfigError(f"stratkit.tune() does not know {type(obj).__module__}.{type(obj).__qualname__}. Fix: pass a "
                      f"tuner of a supported library ({supported}), e.g. stratkit.tune(keras_tuner.RandomSearch(...))")


__all__ = ["ADAPTERS", "SearchFailed", "SearchUnreachable", "tune"]
