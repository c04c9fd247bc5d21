"""Real object stores for the tests, on loopback (or on a test host): moto's S3 server, gcp-storage-emulator
(GCS) and Azurite (Azure Blob), each speaking its store's protocol to the real client libraries.

    with S3Server() as s3:
        s3.make_bucket("runs")
        env = s3.env                 # what a training process needs: endpoint, credentials
        url = s3.url("runs", "run1") # s3://runs/run1

Every server is reached through an `Outage` proxy of the test's own, so a test
can take the store down (`server.down()`: connections refused, the open ones
cut) and bring it back (`server.up()`) without losing what it holds.

A server can also run on a test host (`S3Server(host=h3)`: tests/hosts.py), as a store is a network
service every machine reaches and none holds on its disk: it listens on the host's 198.18 address,
which the training processes on the other hosts get as their endpoint (`env`), while the test's own
clients (`fs()`, `make_bucket`) go through the proxy, whose connections to the server are made in the
store host's network namespace (the root namespace has no route to the hosts). Such a store goes off
the network with `Host.unplug()`, not `down()`.

S3 checks credentials (moto's IAM: the keys `env` gives are made at start, any
other key is refused); Azurite checks its account key; the GCS emulator checks
none. None of them reaches anything but loopback (Azurite's telemetry is off:
``--disableTelemetry``; the clients' metadata-server lookups are off through
the variables in `env`).

Azurite is an npm package: ``make test`` installs it into
``~/.cache/stratkit-test/azurite`` (`AZURITE`); without it the Azure tests skip,
or fail under STRATKIT_REQUIRE_STORES=1 (CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

AZURITE = Path(os.environ.get("STRATKIT_AZURITE_DIR", Path.home() / ".cache" / "stratkit-test" / "azurite")) / \
    "node_modules" / ".bin" / "azurite-blob"
REQUIRE_VARIABLE = "STRATKIT_REQUIRE_STORES"
#: Azurite's development account: a well-known, published key (not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: Variables of the developer's own environment that would point a client elsewhere: never inherited.
CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
           "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
           "AZURE_STORAGE_SAS_TOKEN")


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL it when the test process that started it dies (a pytest
    killed by a timeout runs no teardown; its servers must not outlive it)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None,
                  connect: Callable[[tuple[str, int], float], socket.socket] = socket.create_connection) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it listened on {host}:{port}")
        try:
            connect((host, port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listened on {host}:{port} within {timeout} s")


class Outage:
    """A TCP proxy on loopback in front of a server: `down()` refuses new connections and cuts the open ones,
    `up()` serves again on the same port (what a store that went down and came back looks like to a client)."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1",
                 connect: Callable[[tuple[str, int], float], socket.socket] = socket.create_connection) -> None:
        self.target = target
        self.host = host
        self._connect = connect  # how a connection to the target is made (from a test host's namespace)
        self.port = free_port(host)
        self._listener: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._marker: bytes | None = None
        self._held: dict[socket.socket, bytearray] = {}
        self._thread: threading.Thread | None = None
        self.up()

    def up(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(64)
            self._listener = listener
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(listener,), name="store-outage-proxy", daemon=True)
        self._thread.start()

    def hold(self, marker: bytes = b"") -> None:
        """From now on, a connection whose client sends `marker` (b"": any byte) is held: what it sends is kept,
        nothing is answered, so its request hangs mid-way; the others go on. `resume` sends the held bytes on."""
        self._marker = marker

    def resume(self) -> None:
        self._marker = None

    def down(self) -> None:
        self._stop.set()
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, []
        if listener is not None:
            listener.close()
        for a, b in pairs:
            for sock in (a, b):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        if self._thread is not None:
            self._thread.join(5)

    def _serve(self, listener: socket.socket) -> None:
        buffers: dict[socket.socket, socket.socket] = {}
        # a thread that outlived `down()`'s join (a busy machine) ends when it sees another listener: revived by
        # the next `up()` it would spin on its closed one beside the new thread
        while not self._stop.is_set() and self._listener is listener:
            with self._lock:
                pairs = list(self._pairs)
            marker = self._marker
            if marker is None and self._held:  # resumed: what was held goes on first
                for client, data in list(self._held.items()):
                    try:
                        buffers[client].sendall(bytes(data))
                    except (OSError, KeyError):
                        pass
                self._held.clear()
            # a held connection's upstream is not read (nothing reaches the server: nothing comes back)
            watched = [listener] + [s for pair in pairs for s in pair if s is pair[0] or pair[0] not in self._held]
            clients = {pair[0] for pair in pairs}
            try:
                ready, _, _ = select.select(watched, [], [], 0.1)
            except (OSError, ValueError):
                continue
            for sock in ready:
                if sock is listener:
                    try:
                        client, _ = listener.accept()
                        upstream = self._connect(self.target, 5)
                    except OSError:
                        continue
                    with self._lock:
                        self._pairs.append((client, upstream))
                    buffers[client], buffers[upstream] = upstream, client
                    continue
                peer = buffers.get(sock)
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data or peer is None:
                    self._held.pop(sock, None)
                    self._drop(sock, peer)
                    continue
                if sock in self._held or (marker is not None and marker in data and sock in clients):
                    self._held.setdefault(sock, bytearray()).extend(data)
                    continue
                try:
                    peer.sendall(data)
                except OSError:
                    self._drop(sock, peer)

    def _drop(self, a: socket.socket, b: socket.socket | None) -> None:
        with self._lock:
            self._pairs = [p for p in self._pairs if a not in p]
        for sock in (a, b):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass


class StoreServer:
    """One store server on loopback behind an `Outage` proxy (`start` in `__enter__`, killed in `__exit__`), or on
    test host `host` (see the module docstring)."""

    scheme = ""

    def __init__(self, host: Any = None) -> None:
        self.host = host
        self.address = host.address if host is not None else "127.0.0.1"  # where the server listens
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.proxy: Outage | None = None
        self.workdir = tempfile.mkdtemp(prefix=f"stratkit-{type(self).__name__.lower()}-")
        self.log = Path(self.workdir) / "server.log"

    # -- the server ----------------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def server_env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k not in CLEARED}

    def start(self) -> StoreServer:
        self.port = free_port()
        connect = self.host.connect if self.host is not None else socket.create_connection
        with open(self.log, "ab") as log:
            if self.host is None:
                self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                             env=self.server_env(), start_new_session=True, cwd=self.workdir,
                                             preexec_fn=_die_with_parent)
            else:  # its working directory on the host's own disk (a private /tmp does not have ours)
                self.host.run(["mkdir", "-p", self.workdir], timeout=30, check=True)
                self.proc = self.host.popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=self.server_env(), start_new_session=True, cwd=self.workdir,
                                            preexec_fn=_die_with_parent)
        try:
            wait_for_port(self.address, self.port, 60, self.proc, connect)
        except BaseException:
            self.stop()
            raise RuntimeError(f"{type(self).__name__} did not start: {self.log.read_text()[-2000:]}") from None
        self.proxy = Outage((self.address, self.port), connect=connect)
        self.ready()
        return self

    def ready(self) -> None:
        """After the server listens: what it needs before clients use it (keys, ...)."""

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.down()
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except OSError:
                pass
            self.proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> StoreServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- outages -------------------------------------------------------------------------------
    def down(self) -> None:
        """The store goes down: connections refused, open ones cut (what it holds is kept)."""
        self._on_loopback("down")
        assert self.proxy is not None
        self.proxy.down()

    def up(self) -> None:
        assert self.proxy is not None
        self.proxy.resume()
        self.proxy.up()

    def hold(self, marker: bytes = b"") -> None:
        """The store stops answering the requests that name `marker` (b"": every request, and every one under
        way): they hang until `up()`; the others are served."""
        self._on_loopback("hold")
        assert self.proxy is not None
        self.proxy.hold(marker)

    @property
    def held(self) -> bytes:
        """What the held requests sent (requests under way that the store does not answer)."""
        assert self.proxy is not None
        return b"".join(bytes(data) for data in list(self.proxy._held.values()))

    def _on_loopback(self, what: str) -> None:
        if self.host is not None:  # the proxy is the test's own way in, not the hosts'
            raise RuntimeError(f"{what}() acts on the proxy, which the hosts do not use: unplug the store's host "
                               f"({self.host.name}) instead")

    # -- for clients ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The URL clients of the store use: the proxy's on loopback; on a test host, the server's own address
        (what the other hosts reach; the test's process uses `client_endpoint`)."""
        if self.host is not None:
            return f"http://{self.address}:{self.port}"
        return self.client_endpoint

    @property
    def client_endpoint(self) -> str:
        """The URL this test process reaches the store at (always the proxy on loopback)."""
        assert self.proxy is not None
        return f"http://127.0.0.1:{self.proxy.port}"

    @property
    def env(self) -> dict[str, str]:
        """The variables a client process needs (added to a clean copy of the environment)."""
        raise NotImplementedError

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: os.environ) without the developer's own store settings, plus `env`."""
        out = {k: v for k, v in (base if base is not None else os.environ).items() if k not in CLEARED}
        out.update(self.env)
        return out

    def url(self, bucket: str, *parts: str) -> str:
        return f"{self.scheme}://" + "/".join([bucket, *[p.strip("/") for p in parts if p]])

    def fs(self) -> Any:
        """An fsspec filesystem on this server for the test's own checks (explicit options, no environment)."""
        raise NotImplementedError

    def make_bucket(self, name: str) -> str:
        self.fs().mkdir(name)
        return name


class S3Server(StoreServer):
    """moto's S3 server with IAM on: only the keys made at start (`env`) are accepted."""

    scheme = "s3"
    #: Requests moto serves before it starts checking signatures (the user, policy and key made in `ready`).
    _UNCHECKED = 4

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", self.address, "-p", str(self.port)]

    def server_env(self) -> dict[str, str]:
        env = super().server_env()
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(self._UNCHECKED)
        return env

    def ready(self) -> None:
        import boto3

        iam = boto3.client("iam", endpoint_url=self.client_endpoint, region_name="us-east-1",
                           aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="stratkit-tests")
        policy = iam.create_policy(PolicyName="everything", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        iam.attach_user_policy(UserName="stratkit-tests", PolicyArn=policy["Policy"]["Arn"])
        key = iam.create_access_key(UserName="stratkit-tests")["AccessKey"]
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def read_only_env(self) -> dict[str, str]:
        """`env` with the keys of a second IAM user that may only read (a worker that must never write)."""
        if not hasattr(self, "_reader"):
            import boto3

            iam = boto3.client("iam", endpoint_url=self.client_endpoint, region_name="us-east-1",
                               aws_access_key_id=self.key, aws_secret_access_key=self.secret)
            iam.create_user(UserName="stratkit-reader")
            # moto 5.2 checks the operation's own name for a listing and a HEAD (s3:ListObjectsV2, s3:HeadObject),
            # where AWS checks s3:ListBucket and s3:GetObject: both names, or the reader may not read
            policy = iam.create_policy(PolicyName="read-only", PolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Resource": "*", "Action": [
                    "s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation", "s3:ListObjectsV2", "s3:HeadObject"]}]}))
            iam.attach_user_policy(UserName="stratkit-reader", PolicyArn=policy["Policy"]["Arn"])
            key = iam.create_access_key(UserName="stratkit-reader")["AccessKey"]
            self._reader = (key["AccessKeyId"], key["SecretAccessKey"])
        return {**self.env, "AWS_ACCESS_KEY_ID": self._reader[0], "AWS_SECRET_ACCESS_KEY": self._reader[1]}

    def fs(self, **options: Any) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.client_endpoint,
                                 skip_instance_cache=True, use_listings_cache=False, **options)

    def make_bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.client_endpoint, region_name="us-east-1", aws_access_key_id=self.key,
                     aws_secret_access_key=self.secret).create_bucket(Bucket=name)
        return name


class GCSServer(StoreServer):
    """gcp-storage-emulator (in memory; the proxy keeps it through an outage). Checks no credentials."""

    scheme = "gs"

    def command(self) -> list[str]:
        # The emulator's command line with its multipart reading made byte-exact (tests/gcs_emulator.py).
        return [sys.executable, str(Path(__file__).parent / "gcs_emulator.py"), "start", "--host", self.address,
                "--port", str(self.port), "--in-memory"]

    @property
    def env(self) -> dict[str, str]:
        # gcsfs's bucket-type probe speaks gRPC, which the emulator does not: off. The anonymous token keeps
        # google-auth from looking for credentials (a metadata server) at all.
        return {"STORAGE_EMULATOR_HOST": self.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
                "FSSPEC_GS": json.dumps({"token": "anon", "project": "stratkit-tests"}),
                "GOOGLE_CLOUD_PROJECT": "stratkit-tests", "NO_GCE_CHECK": "true"}

    def fs(self, **options: Any) -> Any:
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import gcsfs

        return gcsfs.GCSFileSystem(endpoint_url=self.client_endpoint, token="anon", project="stratkit-tests",
                                   skip_instance_cache=True, use_listings_cache=False, **options)


class AzureServer(StoreServer):
    """Azurite's Blob service, checking its account key; telemetry off."""

    scheme = "az"

    def command(self) -> list[str]:
        return [str(AZURITE), "--blobHost", self.address, "--blobPort", str(self.port), "--location", self.workdir,
                "--skipApiVersionCheck", "--loose", "--disableTelemetry", "--silent"]

    def connection_string(self, key: str = AZURITE_KEY, endpoint: str | None = None) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={endpoint or self.endpoint}/{AZURITE_ACCOUNT};")

    @property
    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def fs(self, **options: Any) -> Any:
        import adlfs

        return adlfs.AzureBlobFileSystem(connection_string=self.connection_string(endpoint=self.client_endpoint),
                                         skip_instance_cache=True,
                                         use_listings_cache=False, **options)


SERVERS = {"s3": S3Server, "gs": GCSServer, "az": AzureServer}


def _filesystem_classes() -> list:
    import fsspec

    out = []
    for protocol in ("s3", "gs", "az"):
        try:
            out.append(fsspec.get_filesystem_class(protocol))
        except (ImportError, ValueError):
            pass
    return out


def refresh_clients() -> None:
    """Make this process's clients read the settings again: fsspec's config (read from FSSPEC_* once, at
    import) from os.environ, and no filesystem cached with older credentials."""
    import fsspec.config

    fsspec.config.conf.clear()
    fsspec.config.set_conf_env(fsspec.config.conf, os.environ)
    for cls in _filesystem_classes():
        cls.clear_instance_cache()


@contextlib.contextmanager
def client_settings(*servers: StoreServer) -> Iterator[None]:
    """The servers' client settings in this process's os.environ and fsspec's config for the block (for a
    module-scoped fixture, where pytest's monkeypatch cannot go); everything as it was afterwards."""
    import fsspec.config

    saved_env = dict(os.environ)
    saved_conf = {k: dict(v) for k, v in fsspec.config.conf.items()}
    try:
        for name in CLEARED:
            os.environ.pop(name, None)
        for server in servers:
            os.environ.update(server.env)
        refresh_clients()
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        fsspec.config.conf.clear()
        fsspec.config.conf.update(saved_conf)
        for cls in _filesystem_classes():
            cls.clear_instance_cache()


def unavailable_reason(scheme: str) -> str | None:
    """Why the `scheme` server cannot run here (None: it can)."""
    if scheme == "az" and not AZURITE.exists():
        return f"Azurite is not installed at {AZURITE} (make test installs it with npm)"
    return None


def gate(scheme: str) -> None:
    """Skip (or, with STRATKIT_REQUIRE_STORES=1, fail) a test whose store cannot run here."""
    import pytest

    reason = unavailable_reason(scheme)
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{REQUIRE_VARIABLE}=1 but {reason}", pytrace=False)
    pytest.skip(reason)
