"""The storage layer against real servers of each store (moto S3, the GCS emulator, Azurite) and a local
directory: whole-object writes, listings, directories, and the start-up check's errors."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading

import pytest
from procs import REPO_ROOT

from stratkit import storage
from stratkit.errors import ConfigError

SCHEMES = ["s3", "gs", "az"]


def _unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{os.urandom(3).hex()}"


@pytest.fixture(params=["local"] + SCHEMES)
def root(request, use_store, tmp_path):
    """A fresh store root: a local directory, or a new bucket's prefix on each server."""
    if request.param == "local":
        return str(tmp_path / "store")
    server = use_store(request.param)
    bucket = server.make_bucket(_unique("bkt"))
    return server.url(bucket, "prefix")


def test_whole_objects_listings_and_directories(root, tmp_path):
    store = storage.check_store(root, "backup_dir")
    store.write_bytes("a/one.json", b"1")
    store.write_bytes("a/one.json", b"22")                 # replaced whole
    source = tmp_path / "weights.bin"
    source.write_bytes(os.urandom(3 << 20))                # several MiB: a multipart upload on S3
    store.upload(str(source), "b/weights.bin")
    assert store.read_bytes("a/one.json") == b"22"
    assert store.size("b/weights.bin") == 3 << 20
    assert store.list() == ["a/one.json", "b/weights.bin"]
    assert store.list("a") == ["a/one.json"]
    assert store.exists("a/one.json") and not store.exists("a/two.json")
    store.download("b/weights.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/missing.json")

    tree = tmp_path / "tree"
    (tree / "variables").mkdir(parents=True)
    (tree / "variables" / "v.data").write_bytes(b"v")
    (tree / "saved_model.pb").write_bytes(b"pb")
    store.write_bytes("export/stale.txt", b"old")
    assert sorted(store.upload_dir(str(tree), "export", last=["saved_model.pb"])) == ["saved_model.pb",
                                                                                     "variables/v.data"]
    assert store.list("export") == ["export/saved_model.pb", "export/variables/v.data"]   # the stale one gone
    assert sorted(store.download_dir("export", str(tmp_path / "copy"))) == ["saved_model.pb", "variables/v.data"]
    assert (tmp_path / "copy" / "variables" / "v.data").read_bytes() == b"v"

    store.remove("a/one.json")
    store.remove("a/one.json")                             # missing: nothing
    store.remove_all()
    assert store.list() == []


def test_every_byte_arrives_whatever_the_object_ends_with(root, tmp_path):
    """Line endings at the end of an object are content: an emulator that took a final
    carriage return for its multipart framing stored 1 random upload in 256 a byte short (tests/gcs_emulator.py)."""
    store = storage.check_store(root, "backup_dir")
    for number, tail in enumerate([b"\r", b"\n", b"\r\n", b"\r\n\r\n", b"\x00"]):
        data = os.urandom(64) + tail
        (tmp_path / "object.bin").write_bytes(data)
        store.upload(str(tmp_path / "object.bin"), f"tail/{number}.bin")
        store.write_bytes(f"tail/{number}.bytes", data)
        assert store.read_bytes(f"tail/{number}.bin") == data, tail
        assert store.read_bytes(f"tail/{number}.bytes") == data, tail


def test_write_with_and_local_copy_land_whole(root, tmp_path):
    target = storage.join(root, "out", "model.bin")
    written = storage.write_with(target, lambda tmp: open(tmp, "wb").write(b"x" * 1000), "path")
    assert written == target
    with storage.local_copy(target) as local:
        assert open(local, "rb").read() == b"x" * 1000
        assert os.path.basename(local) == "model.bin"

    def fails(tmp: str) -> None:
        open(tmp, "wb").write(b"half")
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError):
        storage.write_with(target, fails, "path")
    with storage.local_copy(target) as local:
        assert open(local, "rb").read() == b"x" * 1000     # the old file stands
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_missing_bucket_is_a_config_error(scheme, use_store):
    server = use_store(scheme)
    with pytest.raises(ConfigError, match=r"bucket or container '[^']+' does not exist.*Fix: create it"):
        storage.check_store(server.url(_unique("missing"), "run1"), "backup_dir")


def test_wrong_s3_credentials_are_a_config_error(use_store, monkeypatch):
    server = use_store("s3")
    bucket = server.make_bucket(_unique("creds"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    use_store.refresh()
    with pytest.raises(ConfigError) as caught:
        storage.check_store(server.url(bucket, "run1"), "backup_dir")
    text = str(caught.value)
    assert "refused the credentials" in text and "AWS_SECRET_ACCESS_KEY" in text
    assert "wrong-secret-value" not in text and server.secret not in text


def test_wrong_azure_key_is_a_config_error(use_store, monkeypatch):
    server = use_store("az")
    container = server.make_bucket(_unique("creds"))
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string(key="d3Jvbmc="))
    use_store.refresh()
    with pytest.raises(ConfigError, match="refused the credentials") as caught:
        storage.check_store(server.url(container, "run1"), "backup_dir")
    assert "d3Jvbmc=" not in str(caught.value)


def test_store_down_at_start_is_a_config_error(use_store):
    server = use_store("s3")
    bucket = server.make_bucket(_unique("down"))
    server.down()
    try:
        with pytest.raises(ConfigError, match="could not be reached.*Fix: check the store's endpoint"):
            storage.check_store(server.url(bucket, "run1"), "backup_dir")
    finally:
        server.up()
    storage.check_store(server.url(bucket, "run1"), "backup_dir")       # back: fine


def test_a_store_that_never_answers_times_out(monkeypatch, use_store):
    use_store("s3")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)                                      # accepts, never answers
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("STRATKIT_STORE_TIMEOUT", "3")
    use_store.refresh()
    try:
        with pytest.raises(ConfigError, match="did not answer within 3 s"):
            storage.check_store("s3://quiet-bucket/run1", "backup_dir")
    finally:
        silent.close()       # the probe's connections are reset: its thread gives up
        for thread in threading.enumerate():
            if thread.name == "stratkit-store-probe":
                thread.join(120)   # before this test's settings are undone under it


def test_settings_fixed_in_a_running_process_are_used_by_the_next_call(monkeypatch, use_store):
    """A notebook's (or a tuning host's) process lives on: after a refused secret or a wrong endpoint is fixed in
    the environment, as the error's Fix says, the next call uses the new settings, with no restart (fsspec's
    own cache answered with the client made under the old ones)."""
    server = use_store("s3")
    bucket = server.make_bucket(_unique("fixed"))
    good_secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "d3Jvbmc=")
    with pytest.raises(ConfigError, match="refused the credentials"):
        storage.check_store(server.url(bucket, "run1"), "backup_dir")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good_secret)
    storage.check_store(server.url(bucket, "run1"), "backup_dir")

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("STRATKIT_STORE_TIMEOUT", "120")   # the client's retries on a refused port end first
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))                        # a port nothing listens on
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
    try:
        with pytest.raises(ConfigError, match="could not be reached"):
            storage.check_store(server.url(bucket, "run2"), "backup_dir")
    finally:
        closed.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = storage.check_store(server.url(bucket, "run2"), "backup_dir")
    store.write_bytes("kept", b"1")
    assert server.fs().cat_file(f"{bucket}/run2/kept") == b"1"          # on the server the test started


class _NotHere(http.server.BaseHTTPRequestHandler):
    """Another server at the address a wrong setting names: every request is 404."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_a_gcs_or_azure_setting_fixed_in_a_running_process_is_used_by_the_next_call(monkeypatch, use_store, scheme):
    """The same on the GCS emulator (its endpoint moved, then back: STORAGE_EMULATOR_HOST) and on Azurite (a
    wrong account key in the connection string, then the right one): the next call uses the settings of now."""
    server = use_store(scheme)
    bucket = server.make_bucket(_unique("fixed"))
    name = "STORAGE_EMULATOR_HOST" if scheme == "gs" else "AZURE_STORAGE_CONNECTION_STRING"
    good = os.environ[name]
    # The wrong GCS endpoint is a server that answers 404 to everything: gcsfs gives up on it at once (on a
    # refused port it retried for ~30 s, backing off).
    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotHere)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    try:
        if scheme == "gs":
            monkeypatch.setenv(name, f"http://127.0.0.1:{elsewhere.server_address[1]}")
        else:
            key = good.split("AccountKey=", 1)[1].split(";", 1)[0]
            monkeypatch.setenv(name, good.replace(key, "d3Jvbmcga2V5IG9mIDMyIGJ5dGVzIGV4YWN0bHkhIQ=="))
        with pytest.raises(ConfigError):
            storage.check_store(server.url(bucket, "run"), "backup_dir")
    finally:
        elsewhere.shutdown()
        elsewhere.server_close()
    monkeypatch.setenv(name, good)
    store = storage.check_store(server.url(bucket, "run"), "backup_dir")
    store.write_bytes("kept", b"1")
    assert server.fs().cat_file(f"{bucket}/run/kept") == b"1"          # on the server the test started


def test_a_url_whose_filesystem_is_missing_names_the_extra():
    code = ("import sys; sys.modules['s3fs'] = None; sys.modules['adlfs'] = None\n"
            "from stratkit import storage\n"
            "for url in ('s3://b/run', 'abfs://c/run'):\n"
            "    try:\n"
            "        storage.open_store(url, 'backup_dir')\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ConfigError") and 'pip install "stratkit[s3]"' in lines[0]
    assert lines[1].startswith("ConfigError") and 'pip install "stratkit[azure]"' in lines[1]


def test_paths_that_are_not_what_they_seem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"local directory named 's3:'.*Fix: backup_dir='s3://bucket/run'"):
        storage.open_store("s3:/bucket/run", "backup_dir")
    with pytest.raises(ConfigError, match="names a file on host 'elsewhere'"):
        storage.open_store("file://elsewhere/x", "path")
    with pytest.raises(ConfigError, match="names no bucket"):
        storage.open_store("s3://", "backup_dir")
    with pytest.raises(ConfigError, match="nosuchscheme://"):
        storage.open_store("nosuchscheme://b/x", "backup_dir")
    assert storage.open_store(f"file://{tmp_path}/d", "path").local
    assert storage.local_path(f"file://{tmp_path}/d") == f"{tmp_path}/d"
    assert not storage.is_url(f"file://{tmp_path}") and storage.is_url("gs://b/x") and not storage.is_url("a/b")
    assert list(tmp_path.iterdir()) == []


def test_messages_never_show_secrets():
    shown = storage.redact("s3://KEYID:SECRET@bucket/run?X-Amz-Signature=abc&sig=def")
    assert shown == "s3://bucket/run"
    with pytest.raises(ConfigError) as caught:
        storage.open_store("nosuchscheme://user:pw@b/x?token=zzz", "backup_dir")
    assert "pw" not in str(caught.value).replace("pip", "") and "zzz" not in str(caught.value)


def test_hdfs_goes_through_pyarrow_and_says_what_it_needs(monkeypatch):
    """No HDFS server runs here: the URL reaches fsspec's pyarrow filesystem, whose libhdfs is missing."""
    monkeypatch.delenv("HADOOP_HOME", raising=False)
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"hdfs:// filesystem \(pyarrow\).*Java and HADOOP_HOME"):
        storage.open_store("hdfs://namenode:8020/runs/run1", "backup_dir")
