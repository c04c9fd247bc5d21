"""A search as a Slurm job step: `srun --ntasks N python search.py`, each task a tuner, task 0 its service.

Slurm starts the N processes itself, on machines that may share nothing, so
no engine hands them `stratkit.tuning.environment`'s variables. Each task
works its part out from what srun gives every task (`stratkit.cluster.slurm`,
the detection the training clusters use too):

* its tuner id: `SLURM_PROCID`; the search's tuners: `SLURM_STEP_NUM_TASKS`;
* who hosts the service: task 0, beside its own tuner;
* where: task 0's address in the step's cluster (`slurm_cluster`: the first
  host of `SLURM_STEP_NODELIST`, port `STRATKIT_SLURM_PORT`, default 8888: the
  port its TensorFlow server would take, unused in a search); on a step of
  one node, loopback; `STRATKIT_TUNE_HOST` names another address to listen on
  and dial (a cluster network the node's name does not resolve to);
* the token: `STRATKIT_TUNE_TOKEN`, which the user exports before srun
  (srun passes the environment on to every task: `--export=ALL`, its
  default). Nothing else is shared between the machines: the
  token is the secret the service checks, as `STRATKIT_RDZV_TOKEN` is for a
  multi-node launch's rendezvous (`stratkit.launch.nodelink`).

A step's task that cannot reach task 0 keeps trying for
`STRATKIT_TUNE_CONNECT_SECONDS` (task 0 may start later); a task that dies
after the search started is a lease that expires (srun ends the whole step
on a task's bad exit only with `--kill-on-bad-exit`, or `KillOnBadExit=1` in
slurm.conf: pass `--kill-on-bad-exit=0` where that is set). Task 0 is the one
that matters: with it the search stops, and a requeued job (or a new srun
with the same store) resumes it from its store.

Imports no TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from stratkit.cluster import slurm
from stratkit.errors import ConfigError
from stratkit.tuning import environment

ENGINE = "srun"
#: What the user runs to make a token (a shell line, in messages and docs).
MAKE_TOKEN = "export STRATKIT_TUNE_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')"


def from_slurm(environ: Mapping[str, str] | None = None) -> environment.TuneEnv | None:
    """This task's part in a search run as an srun step of several tasks; None outside one.

    Raises:
        ConfigError: STRATKIT_TUNE_TOKEN is missing or too short, or the step's variables are malformed.
    """
    env = os.environ if environ is None else environ
    if env.get("STRATKIT_CLUSTER_ENV", "").strip().lower() == "none" or not slurm.is_slurm_step(env):
        return None
    cluster, rank = slurm.slurm_cluster(env)
    workers = cluster["worker"]
    host, port = environment.parse_address(workers[0], "task 0's address in the Slurm step")
    hosts = {environment.parse_address(address, "a task's address")[0] for address in workers}
    named = env.get(environment.HOST_VAR, "").strip()
    if named:
        host = named
    elif len(hosts) == 1:  # every tuner on this node: loopback only
        host = environment.DEFAULT_HOST
    token = env.get(environment.TUNE_TOKEN_VAR, "")
    if len(token) < environment.MIN_TOKEN:
        raise ConfigError(f"this search runs as task {rank} of an srun step of {len(workers)} tasks, a tuner each, "
                          f"and needs {environment.TUNE_TOKEN_VAR} (at least {environment.MIN_TOKEN} characters: the "
                          f"secret task 0's search service checks; got {len(token)}). Fix: before srun, "
                          f"{MAKE_TOKEN}; or run `python search.py` without srun for one process")
    return environment.from_environ({environment.ADDRESS_VAR: environment.format_address(host, port),
                                     environment.TUNE_TOKEN_VAR: token, environment.TUNER_VAR: str(rank),
                                     environment.TUNERS_VAR: str(len(workers)),
                                     environment.SERVE_VAR: "1" if rank == 0 else "0",
                                     environment.ENGINE_VAR: ENGINE})


__all__ = ["ENGINE", "MAKE_TOKEN", "from_slurm"]
