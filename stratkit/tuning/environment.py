"""How a process learns its part in a distributed search: the environment an engine hands each tuner.

An engine (`stratkit launch --tune`, `LocalRunner(tune=True)`, and the Spark,
Ray and Slurm runners that build on this package) starts one process per tuner
and gives each the variables below; `stratkit.tuning.session` reads them and
decides what the process is:

  * none of them: a search in one process (the service runs in-process);
  * `STRATKIT_TUNE_SERVE=1`: this process hosts the search service at
    `STRATKIT_TUNE_ADDRESS` beside its own tuner (the launcher's worker 0);
  * otherwise: a tuner that reaches the service at `STRATKIT_TUNE_ADDRESS`
    (the driver's, or the host task's).

What an engine must do, in order:

1. `new_token()` once per search (a secret the service's listener checks,
   `stratkit.process.listener.AuthListener`), and where the service listens:
   loopback (`DEFAULT_HOST`) unless the tuners run on other machines; then the
   address those machines reach this one at (the launcher's `--nnodes`
   rendezvous address, Spark's driver host, Ray's node address), or
   `STRATKIT_TUNE_HOST` when the user names it;
2. `task_env(...)` for each tuner process, merged into its environment (the
   token travels only in the environment of processes the engine starts,
   as `STRATKIT_RDZV_TOKEN` and the Spark log server's token do);
3. no TF_CONFIG: each tuner trains its trials alone on its own devices;
4. a tuner's death is not the search's failure (its lease expires and its
   trial runs again elsewhere): only the process hosting the service is
   vital; `started(markers)` says whether a search got past its start
   (before it, a dead tuner is a configuration problem: fail the run), and
   `ended(markers)` whether every search that started also ended.

Imports no TensorFlow.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from stratkit import files
from stratkit.errors import ConfigError

ADDRESS_VAR = "STRATKIT_TUNE_ADDRESS"
TUNE_TOKEN_VAR = "STRATKIT_TUNE_TOKEN"
#: This tuner's id: a whole number; the processes of one multi-worker trial group share it.
TUNER_VAR = "STRATKIT_TUNE_TUNER"
#: How many tuners the search waits for before its first trial (each registers once).
TUNERS_VAR = "STRATKIT_TUNE_TUNERS"
#: "1": this process hosts the service at ADDRESS beside its own tuner.
SERVE_VAR = "STRATKIT_TUNE_SERVE"
#: "<rank>/<size>": this process is worker <rank> of a multi-worker trial group of <size> (`stratkit.tuning.groups`).
GROUP_VAR = "STRATKIT_TUNE_GROUP"
#: A directory on this machine where the host writes `started` and `done` (the launcher reads them).
MARKERS_VAR = "STRATKIT_TUNE_MARKERS"
#: Who started the tuners, for messages ("stratkit launch --tune", "LocalRunner", ...).
ENGINE_VAR = "STRATKIT_TUNE_ENGINE"
#: The driver's working directory: where a tuner resolves a relative store or KerasTuner `directory` (an engine
#: that runs each tuner in a working directory of its own, Ray's actors, Spark's executors, still finds one store).
WORKDIR_VAR = "STRATKIT_TUNE_WORKDIR"
#: The address the service listens on when the engine does not choose (a multi-machine search).
HOST_VAR = "STRATKIT_TUNE_HOST"
#: Seconds a lease lives without a heartbeat (default `LEASE_SECONDS`).
LEASE_VAR = "STRATKIT_TUNE_LEASE_SECONDS"
#: Seconds a tuner keeps trying to reach the service (a slow host start, a restarted chief).
CONNECT_VAR = "STRATKIT_TUNE_CONNECT_SECONDS"
#: Seconds the service waits for every tuner to register before the first trial.
START_VAR = "STRATKIT_TUNE_START_SECONDS"

DEFAULT_HOST = "127.0.0.1"
LEASE_SECONDS = 30.0
CONNECT_SECONDS = 600.0
START_SECONDS = 300.0
MIN_TOKEN = 16

#: Marker files in the MARKERS directory, per search of the run (`started_name(k)`, `done_name(k)`).
STARTED = "started"
DONE = "done"


@dataclass(frozen=True)
class TuneEnv:
    """This process's part in a distributed search, as its engine set it (`from_environ`)."""

    address: tuple[str, int]
    token: str
    tuner: int
    tuners: int
    serve: bool
    markers: str | None
    engine: str
    #: This process's place in its tuner's multi-worker trial group: (rank, size); (0, 1) alone.
    group: tuple[int, int] = (0, 1)

    @property
    def label(self) -> str:
        """How messages name this tuner."""
        rank, size = self.group
        return f"tuner {self.tuner}" + (f" (worker {rank} of its {size})" if size > 1 else "")


def new_token() -> str:
    """A fresh secret for one search (32 hex digits)."""
    return secrets.token_hex(16)


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    text = env.get(name, "").strip()
    if not (text.isdigit() and int(text) >= minimum):
        raise ConfigError(f"{name}={text!r} is not a whole number >= {minimum}. It is set by the engine that "
                          "started this tuner. Fix: start the search with `stratkit launch --tune` or "
                          "LocalRunner(tune=True), or unset the STRATKIT_TUNE_* variables to search in one process")
    return int(text)


def parse_address(text: str, name: str = ADDRESS_VAR) -> tuple[str, int]:
    """`host:port` ([v6]:port) as (host, port); a ConfigError naming `name` otherwise."""
    host, _, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}={text!r} is not host:port. Fix: e.g. {name}=127.0.0.1:29500 (set by the engine "
                          "that started this tuner)")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def from_environ(environ: Mapping[str, str] | None = None) -> TuneEnv | None:
    """The search this process is part of, or None (no STRATKIT_TUNE_ADDRESS: a search in one process).

    Raises:
        ConfigError: a variable is malformed, or the token is too short.
    """
    env = os.environ if environ is None else environ
    if not env.get(ADDRESS_VAR, "").strip():
        return None
    token = env.get(TUNE_TOKEN_VAR, "")
    if len(token) < MIN_TOKEN or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"{TUNE_TOKEN_VAR} must be at least {MIN_TOKEN} printable ASCII characters without spaces "
                          f"(got {len(token)}). It is set by the engine that started this tuner with {ADDRESS_VAR}. "
                          "Fix: start the search with `stratkit launch --tune` or LocalRunner(tune=True)")
    return TuneEnv(address=parse_address(env[ADDRESS_VAR]), token=token, tuner=_int(env, TUNER_VAR, 0),
                   tuners=_int(env, TUNERS_VAR, 1), serve=env.get(SERVE_VAR, "").strip() == "1",
                   markers=env.get(MARKERS_VAR) or None, engine=env.get(ENGINE_VAR) or "the engine",
                   group=_group(env))


def _group(env: Mapping[str, str]) -> tuple[int, int]:
    text = env.get(GROUP_VAR, "").strip()
    if not text:
        return 0, 1
    rank, _, size = text.partition("/")
    if not (rank.isdigit() and size.isdigit() and int(rank) < int(size)):
        raise ConfigError(f"{GROUP_VAR}={text!r} is not <rank>/<size> with rank < size. It is set by the engine "
                          "that started this tuner (stratkit launch --tune --workers-per-trial K)")
    return int(rank), int(size)


def task_env(address: tuple[str, int], token: str, tuner: int, tuners: int, *, serve: bool = False,
             markers: str | None = None, engine: str = "", group: tuple[int, int] = (0, 1),
             workdir: str | None = None) -> dict[str, str]:
    """The variables one tuner process gets (merge them into its environment); `group`: its (rank, size) in a
    multi-worker trial group (the group shares `tuner`); `workdir`: the driver's working directory (`resolve`)."""
    env = {ADDRESS_VAR: format_address(*address), TUNE_TOKEN_VAR: token, TUNER_VAR: str(tuner),
           TUNERS_VAR: str(tuners),
           SERVE_VAR: "1" if serve else "0"}
    if group[1] > 1:
        env[GROUP_VAR] = f"{group[0]}/{group[1]}"
    if markers:
        env[MARKERS_VAR] = markers
    if engine:
        env[ENGINE_VAR] = engine
    if workdir:
        env[WORKDIR_VAR] = workdir
    return env


def resolve(path: str, environ: Mapping[str, str] | None = None) -> str:
    """A store path as every tuner of the search names it: a URL or an absolute path as it is; a relative one
    against the driver's working directory (`WORKDIR_VAR`), else this process's."""
    if "://" in path or os.path.isabs(path):
        return path
    base = (os.environ if environ is None else environ).get(WORKDIR_VAR, "").strip() or os.getcwd()
    return os.path.normpath(os.path.join(base, path))


def seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """A positive number of seconds from `name`, else `default`; a ConfigError naming it when malformed."""
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={text!r} is not a positive number of seconds. Fix: e.g. {name}={default:g}, or "
                          "unset it")
    return value


def service_host(environ: Mapping[str, str] | None = None) -> str:
    """Where a service whose engine did not choose listens: STRATKIT_TUNE_HOST, else loopback."""
    return (os.environ if environ is None else environ).get(HOST_VAR, "").strip() or DEFAULT_HOST


def started_name(search: int) -> str:
    return f"{STARTED}-{int(search)}"


def done_name(search: int) -> str:
    return f"{DONE}-{int(search)}"


def mark(markers: str | None, name: str) -> None:
    """Write the marker `name` (`started_name(k)`, `done_name(k)`) for the engine, if it asked for markers."""
    if markers:
        os.makedirs(markers, exist_ok=True)
        files.write_bytes(os.path.join(markers, name), b"")


def _names(markers: str | None) -> set[str]:
    try:
        return set(os.listdir(markers)) if markers else set()
    except OSError:
        return set()


def started(markers: str | None) -> bool:
    """Whether a search of the run handed out its first trial (every tuner registered, the store checked)."""
    return any(name.startswith(STARTED + "-") for name in _names(markers))


def ended(markers: str | None) -> bool:
    """Whether every search of the run that started also ended (its results are final)."""
    names = _names(markers)
    searches = [name[len(STARTED) + 1:] for name in names if name.startswith(STARTED + "-")]
    return bool(searches) and all(f"{DONE}-{k}" in names for k in searches)
