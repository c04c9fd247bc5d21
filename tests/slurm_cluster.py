"""A real Slurm cluster on test hosts (tests/hosts.py), for tests.

``slurm_cluster(hosts, workdir)`` starts, all in the foreground as children we own:
munged on h1 with a key made for the test and its own socket (every host reaches the
socket through the shared filesystem; Slurm is pointed at it with ``AuthInfo=socket=``),
slurmctld on h1 and one slurmd per host. Spool, state, logs and the key live in
`workdir`. Leaving the block SIGKILLs the daemons (the hosts' own teardown kills
anything left in their namespaces too). Needs Debian's ``slurm-wlm`` and ``munge``
(:func:`unavailable_reason`).

Use :meth:`SlurmCluster.run` to run ``srun``/``sbatch``/... on h1 with the
cluster's ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hosts import Host

TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")


def unavailable_reason() -> str | None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"Slurm tests need {', '.join(missing)} (apt-get install slurm-wlm munge; .ci/run installs them)"
    return None


def slurm_conf(hosts: Sequence[Host], workdir: Path, socket: Path) -> str:
    head = hosts[0]
    lines = [
        "ClusterName=stratkit",
        f"SlurmctldHost={head.name}({head.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket}",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SlurmdTimeout=30",
        "SlurmctldTimeout=30",
        "KillWait=5",
        "MinJobAge=6",   # sbatch --wait sleeps 2, 8, 32 s between polls while below MinJobAge / 3: keep it at 2 s
        "MessageTimeout=20",
        f"StateSaveLocation={workdir}/state",
        f"SlurmdSpoolDir={workdir}/spool-%n",
        f"SlurmctldPidFile={workdir}/slurmctld.pid",
        f"SlurmdPidFile={workdir}/slurmd-%n.pid",
        f"SlurmctldLogFile={workdir}/slurmctld.log",
        f"SlurmdLogFile={workdir}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    lines += [f"NodeName={h.name} NodeAddr={h.address} CPUs=1 State=UNKNOWN" for h in hosts]
    lines.append(f"PartitionName=test Nodes={','.join(h.name for h in hosts)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


@dataclass
class SlurmCluster:
    hosts: list[Host]
    workdir: Path
    conf: Path
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        for name in list(env):
            if name.startswith("SLURM_"):
                env.pop(name)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            **kw) -> subprocess.CompletedProcess:
        """Run `argv` on h1 (the head) with this cluster's SLURM_CONF; output text, stderr in stdout."""
        return self.hosts[0].run(argv, timeout=timeout, env=self.env(env), **kw)

    def logs(self) -> str:
        parts = []
        for path in sorted(self.workdir.glob("*.log")):
            parts.append(f"--- {path.name} (tail)\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)


def _wait_nodes_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        for daemon in cluster.daemons:
            if daemon.poll() is not None:
                raise RuntimeError(f"a Slurm daemon exited ({daemon.args[-3:]}: {daemon.returncode})\n"
                                   + cluster.logs())
        result = cluster.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
        out = result.stdout
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        if len(states) == len(cluster.hosts) and all(s == "idle" for s in states.values()):
            return
        time.sleep(0.3)
    raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {out!r}\n{cluster.logs()}")


@contextmanager
def slurm_cluster(hosts: Sequence[Host], workdir: Path, start_timeout: float = 60.0) -> Iterator[SlurmCluster]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    workdir.chmod(0o755)
    (workdir / "state").mkdir(exist_ok=True)
    key, socket = workdir / "munge.key", workdir / "munge.socket"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = workdir / "slurm.conf"
    conf.write_text(slurm_conf(hosts, workdir, socket))
    cluster = SlurmCluster(list(hosts), workdir, conf)
    head = hosts[0]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    try:
        cluster.daemons.append(head.popen(
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}",
             f"--pid-file={workdir}/munged.pid", f"--seed-file={workdir}/munge.seed",
             f"--log-file={workdir}/munged.log"], **quiet))
        deadline = time.monotonic() + 10
        while not socket.exists():
            if time.monotonic() > deadline or cluster.daemons[0].poll() is not None:
                raise RuntimeError(f"munged did not start\n{cluster.logs()}")
            time.sleep(0.05)
        cluster.daemons.append(head.popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=cluster.env(), **quiet))
        for host in hosts:
            cluster.daemons.append(host.popen(["slurmd", "-D", "-f", str(conf), "-N", host.name],
                                              env=cluster.env(), **quiet))
        _wait_nodes_idle(cluster, start_timeout)
        yield cluster
    finally:
        for daemon in reversed(cluster.daemons):
            try:
                os.killpg(daemon.pid, 9)
            except OSError:
                pass
            daemon.wait()
