"""A real Slurm cluster on test hosts (tests/hosts.py), for tests.

``slurm_cluster(hosts, workdir)`` starts, all in the foreground as children we own:
munged on h1 with a key made for the test and its own socket (every host reaches the
socket through the shared filesystem; Slurm is pointed at it with ``AuthInfo=socket=``),
slurmctld on h1 and one slurmd per host. Spool, state, logs, each daemon's own
stdout/stderr (``<name>.out``: munged logs there) and the key live in `workdir`. Leaving the block
SIGKILLs the daemons (the hosts' own teardown kills anything left in their namespaces
too). Needs Debian's ``slurm-wlm`` and ``munge`` (:func:`unavailable_reason`).

The cluster is handed over only once it answers: munged encodes a credential,
slurmctld listens and ``scontrol ping`` says it is UP from every host, and ``sinfo``
lists every node idle. Otherwise :class:`SlurmNotReady` names the daemon that does
not answer and shows why: its process state, the TCP listener table of its port in
its host's network namespace (``/proc/<pid>/net/tcp``), the host's interfaces and the
tail of its log and output. :meth:`SlurmCluster.check` looks again: from /proc alone (every
daemon runs and listens; tests/test_slurm_hosts.py does it before each test), or in full.

How a test uses it::

    with hosts.make_hosts(2) as made, slurm_cluster(made, tmp_path / "slurm") as cluster:
        step = cluster.run(["srun", "-N2", "hostname"], timeout=60)          # on h1, the head
        assert step.returncode == 0, step.stdout + cluster.logs()
        job = cluster.run(["sbatch", "--parsable", "job.sh"], timeout=60, host=made[1])  # on h2
        job_id = job.stdout.strip()
        state = cluster.job(job_id)["JobState"]                            # PENDING, RUNNING, ...
        cluster.wait_job(job_id, {"COMPLETED"}, timeout=120)

A finished job's record is kept MinJobAge=4 s or more, then :meth:`SlurmCluster.job` returns
None for it: wait for a final state soon after the job ends (``sbatch --wait`` and ``srun``
return only when the job is over).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hosts import Host

TOOLS = ("munged", "munge", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "scontrol")
CTLD_PORT, SLURMD_PORT = 6817, 6818     # Slurm's defaults, each in its host's own network namespace
POLL = 0.05                             # between two looks at a condition we wait on
#: /proc/net/tcp's state codes (include/net/tcp_states.h)
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
              "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
              "0B": "CLOSING"}


class SlurmNotReady(RuntimeError):
    """A Slurm daemon of the test cluster does not answer; the message names it and says why."""


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
        f"SlurmctldPort={CTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: a requeued job may start only cred_expire + 1 s after its requeue (22.05 job_mgr.c
        # batch_requeue_fini: its new launch credential must postdate the old one's revocation); 120 s by default,
        # 5 is the least Slurm takes
        f"AuthInfo=socket={socket},cred_expire=5",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "SchedulerType=sched/builtin",
        # a requeued job's begin time passes with no event to start it: only the periodic full scheduling
        # pass does (sched_interval, 60 s by default)
        "SchedulerParameters=sched_interval=2",
        "SelectType=select/linear",
        "ReturnToService=2",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SlurmdTimeout=30",
        "SlurmctldTimeout=30",
        "KillWait=5",
        # sbatch --wait polls 2 s after the submit, then every 2 s while 2 >= MinJobAge / 2, else every 8 s (22.05
        # src/sbatch/sbatch.c _job_wait): at 6, a 16 s job was seen done at 26 s; at 4 the record is still
        # kept 4 s, longer than one poll
        "MinJobAge=4",
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


def _last_lines(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({exc.strerror}: {path})"
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _decode_address(text: str) -> tuple[str, int]:
    """'010012C6:1AA1' (/proc/net/tcp: IPv4 in little-endian hex, port in hex) -> ('198.18.0.1', 6817)."""
    address, port = text.split(":")
    if len(address) == 8:
        ip = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
    else:
        ip = f"[{address}]"
    return ip, int(port, 16)


def tcp_table(pid: int, port: int) -> list[str]:
    """The TCP sockets on `port` (local or remote) in the network namespace of process `pid`, read from
    /proc/<pid>/net/tcp and tcp6: one 'STATE local -> remote' row each (LISTEN rows first)."""
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            text = Path(f"/proc/{pid}/net/{name}").read_text()
        except OSError as exc:
            return [f"(cannot read /proc/{pid}/net/{name}: {exc.strerror})"]
        for line in text.splitlines()[1:]:
            fields = line.split()
            local, remote = _decode_address(fields[1]), _decode_address(fields[2])
            if port in (local[1], remote[1]):
                state = TCP_STATES.get(fields[3], fields[3])
                rows.append(f"{state} {local[0]}:{local[1]} -> {remote[0]}:{remote[1]}")
    return sorted(rows, key=lambda row: not row.startswith("LISTEN "))


def _process_state(proc: subprocess.Popen) -> str:
    code = proc.poll()
    if code is not None:
        return f"exited with code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except OSError:
        return "gone"
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    return f"running, state {state}"


@dataclass
class Daemon:
    """One daemon of the cluster: what it is, where it runs, its process, and where it writes."""

    name: str                 # munged, slurmctld, slurmd
    host: Host
    proc: subprocess.Popen
    log: Path | None          # its own log file (munged in the foreground logs to its output)
    output: Path              # its stdout and stderr: what it says when it dies before it can log
    port: int | None = None   # the TCP port it listens on (munged: a unix socket)

    @property
    def label(self) -> str:
        return f"{self.name} on {self.host.name} (pid {self.proc.pid})"

    def listening(self) -> bool:
        """A socket in LISTEN state on its port in its host's network namespace (no process is started)."""
        return self.port is not None and any(row.startswith("LISTEN ") for row in self._table())

    def _table(self) -> list[str]:
        # the host's name holder shares the host's network namespace and lives as long as the host
        pid = self.host.holder.pid if self.host.holder is not None else self.proc.pid
        return tcp_table(pid, self.port) if self.port is not None else []

    def report(self) -> str:
        """Its process state, its port's TCP sockets in its host's network namespace, its log and output tails."""
        lines = [f"--- {self.label}: {_process_state(self.proc)}"]
        if self.port is not None:
            rows = self._table()
            listening = any(row.startswith("LISTEN ") for row in rows)
            lines.append(f"TCP port {self.port} in {self.host.name}'s network namespace"
                         f"{'' if listening else ': nothing listening'}:")
            shown = [row for row in rows if row.startswith("LISTEN ")]
            shown += [row for row in rows if not row.startswith("LISTEN ")][:4]
            more = len(rows) - len(shown)
            lines += [f"  {row}" for row in shown] + ([f"  (+{more} more connections)"] if more > 0 else [])
            lines += [] if rows else ["  (no socket on this port)"]
        if self.log is not None:
            lines.append(f"its log {self.log.name} (tail):\n{_tail(self.log)}")
        # with -D the Slurm daemons also log to stderr: the output repeats the log, up to a last word it missed
        lines.append(f"its output {self.output.name} (tail):\n{_tail(self.output, 5)}")
        return "\n".join(lines)


@dataclass
class SlurmCluster:
    hosts: list[Host]
    workdir: Path
    conf: Path
    members: list[Daemon] = field(default_factory=list)

    @property
    def daemons(self) -> list[subprocess.Popen]:
        """The daemons' processes, in start order (munged, slurmctld, one slurmd per host)."""
        return [d.proc for d in self.members]

    def daemon(self, name: str, host: Host | None = None) -> Daemon:
        """The daemon `name` (munged, slurmctld, slurmd) on `host` (default: the head, h1)."""
        host = host or self.hosts[0]
        return next(d for d in self.members if d.name == name and d.host is host)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Our environment without SLURM_* variables, this cluster's SLURM_CONF, then `extra`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            host: Host | None = None, **kw) -> subprocess.CompletedProcess:
        """Run `argv` (srun, sbatch, scontrol...) on `host` (default: h1, the head) with this cluster's
        SLURM_CONF; output text, stderr in stdout (Host.run's keywords: cwd, check...)."""
        return (host or self.hosts[0]).run(argv, timeout=timeout, env=self.env(env), **kw)

    def job(self, job_id: str | int, host: Host | None = None) -> dict[str, str] | None:
        """`scontrol show job` as a dict (JobState, Reason, NodeList, Restarts, ...); None once Slurm has
        forgotten the job (MinJobAge after its end)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)], timeout=30, host=host)
        if out.returncode != 0:
            if "Invalid job id" in out.stdout:
                return None
            raise SlurmNotReady(f"scontrol show job {job_id}: {out.stdout.strip()}\n{self.why('slurmctld')}")
        return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)

    def wait_job(self, job_id: str | int, states: set[str], timeout: float) -> dict[str, str]:
        """Wait until job `job_id` is in one of `states` (e.g. {"RUNNING"}); its record then."""
        deadline = time.monotonic() + timeout
        record = self.job(job_id)
        while record is None or record.get("JobState") not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {sorted(states)} after {timeout:.0f} s: {record}\n"
                                     + self.logs())
            time.sleep(0.2)
            record = self.job(job_id)
        return record

    def logs(self) -> str:
        """Each daemon's process state (a daemon that died mid-test says how), then the tails of its files."""
        parts = [f"--- {d.label}: {_process_state(d.proc)}" for d in self.members]
        for path in sorted([*self.workdir.glob("*.log"), *self.workdir.glob("*.out")]):
            parts.append(f"--- {path.name} (tail)\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def why(self, *daemons: Daemon | str) -> str:
        """Every host's interfaces, then a report on each daemon given (a Daemon, or all of a name; all if none)."""
        chosen = [d for d in self.members if not daemons or d in daemons or d.name in daemons]
        return "\n".join([_interfaces(self.hosts)] + [d.report() for d in chosen])

    def check(self, full: bool = False, timeout: float = 30.0) -> None:
        """Every daemon runs and listens (read from /proc: no command runs, so it costs nothing before each
        test); with `full`, or when that fails, also munge gives a credential, `scontrol ping` is UP on every
        host and `sinfo` shows every node idle. Raises SlurmNotReady naming the daemon that does not, and why."""
        if full or any(d.proc.poll() is not None or (d.port is not None and not d.listening()) for d in self.members):
            _wait_ready(self, time.monotonic() + timeout, timeout)


def _interfaces(hosts: Sequence[Host]) -> str:
    lines = ["--- interfaces (ip -br addr) per host:"]
    for host in hosts:
        try:
            out = host.run(["ip", "-br", "addr"], timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out = f"(cannot look: {exc})"
        lines.append(f"{host.name}: " + "; ".join(" ".join(line.split()) for line in out.splitlines()))
    return "\n".join(lines)


def _fail_if_dead(cluster: SlurmCluster) -> None:
    for daemon in cluster.members:
        if daemon.proc.poll() is not None:
            raise SlurmNotReady(f"{daemon.label} is not running: {_process_state(daemon.proc)}\n"
                                + cluster.why(daemon))


def _until(cluster: SlurmCluster, ready, deadline: float, waited: float, what: str, culprit: Daemon) -> None:
    """Look at `ready()` every POLL s until it is true; SlurmNotReady naming `culprit` past `deadline` and
    at once if any daemon has exited."""
    while True:
        _fail_if_dead(cluster)
        result = ready()
        if result is True:
            return
        if time.monotonic() > deadline:
            said = f"\nit said: {_last_lines(result, 6)}" if isinstance(result, str) and result else ""
            raise SlurmNotReady(f"{culprit.label} is not answering after {waited:.0f} s: {what}{said}\n"
                                + cluster.why(culprit))
        time.sleep(POLL)


def _wait_ready(cluster: SlurmCluster, deadline: float, waited: float) -> None:
    """munged answers; slurmctld listens and `scontrol ping` is UP on every host; each slurmd listens and
    every node is idle in sinfo. Each looked at until `deadline` (`waited`: for the message)."""
    munged = cluster.daemon("munged")
    socket = cluster.workdir / "munge.socket"
    _until(cluster, lambda: _munge_answers(cluster, socket), deadline, waited,
           f"no credential from its socket {socket}", munged)
    ctld = cluster.daemon("slurmctld")
    _until(cluster, ctld.listening, deadline, waited, f"nothing listens on port {CTLD_PORT}", ctld)
    for host in cluster.hosts:
        def pong(host: Host = host) -> bool | str:
            out = cluster.run(["scontrol", "ping"], timeout=30, host=host).stdout
            return True if " is UP" in out else out.strip()
        _until(cluster, pong, deadline, waited, f"`scontrol ping` on {host.name} does not say UP", ctld)
    for host in cluster.hosts:
        slurmd = cluster.daemon("slurmd", host)
        _until(cluster, slurmd.listening, deadline, waited, f"nothing listens on port {SLURMD_PORT}", slurmd)
    states: dict[str, str] = {}

    def all_idle() -> bool | str:
        out = cluster.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=60).stdout
        states.update(dict(line.split() for line in out.splitlines() if len(line.split()) == 2))
        return True if all(states.get(h.name) == "idle" for h in cluster.hosts) else out.strip()
    try:
        _until(cluster, all_idle, deadline, waited, "its node is not idle in sinfo", cluster.daemon("slurmd"))
    except SlurmNotReady:
        # name the slurmd whose node is not idle (sinfo's compact states: idle, unk*, down*, idle*, ...)
        late = [h for h in cluster.hosts if states.get(h.name) != "idle"] or cluster.hosts
        slurmd = cluster.daemon("slurmd", late[0])
        raise SlurmNotReady(f"{slurmd.label} is not answering after {waited:.0f} s: node {late[0].name} is "
                            f"{states.get(late[0].name, 'not listed')!r} in sinfo ({states})\n"
                            + cluster.why(slurmd, "slurmctld")) from None


def _munge_answers(cluster: SlurmCluster, socket: Path) -> bool | str:
    if not socket.exists():
        return False
    out = cluster.run(["munge", "--no-input", f"--socket={socket}", "--output=/dev/null"], timeout=30)
    return True if out.returncode == 0 else out.stdout.strip()


@contextmanager
def slurm_cluster(hosts: Sequence[Host], workdir: Path, start_timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """A Slurm cluster on `hosts` (the first is the head), handed over once every daemon answers."""
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
    deadline = time.monotonic() + start_timeout

    def start(name: str, host: Host, argv: list[str], log: Path | None, port: int | None, env=None) -> Daemon:
        output = workdir / f"{log.stem if log else name}.out"
        with open(output, "wb") as sink:
            proc = host.popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                              start_new_session=True)
        daemon = Daemon(name, host, proc, log, output, port)
        cluster.members.append(daemon)
        return daemon

    try:
        munged = start("munged", head, [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket}",
            f"--pid-file={workdir}/munged.pid", f"--seed-file={workdir}/munge.seed"], None, None)
        # slurmd's registration needs a credential: munged first
        _until(cluster, lambda: _munge_answers(cluster, socket), deadline, start_timeout,
               f"no credential from its socket {socket}", munged)
        start("slurmctld", head, ["slurmctld", "-D", "-i", "-f", str(conf)], workdir / "slurmctld.log", CTLD_PORT,
              env=cluster.env())
        for host in hosts:
            start("slurmd", host, ["slurmd", "-D", "-f", str(conf), "-N", host.name],
                  workdir / f"slurmd-{host.name}.log", SLURMD_PORT, env=cluster.env())
        _wait_ready(cluster, deadline, start_timeout)
        yield cluster
    finally:
        for daemon in reversed(cluster.members):
            if daemon.proc.poll() is None:      # a reaped daemon's pid (and group) may belong to another now
                try:
                    os.killpg(daemon.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
            daemon.proc.wait()
