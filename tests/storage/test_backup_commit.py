"""Backups on a store, the protocol alone (no TensorFlow): the commit, reading the newest verified backup back,
the attempt fence, and uploads while the store is down. Each worker is an `Uploads` of its own (a thread, as in
training) over local backup directories written as `write_backup` writes them; the store is a real server."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from stratkit import storage
from stratkit.errors import ConfigError
from stratkit.training.checkpoint import commit, copy_backup, find_resume_point, readback, remote
from stratkit.training.checkpoint.layout import STATE, WEIGHTS, Position, file_name, read_metadata, write_metadata
from stratkit.training.checkpoint.uploads import Uploads

P1, P2, P3, P4 = Position(0, 7), Position(1, 4), Position(2, 1), Position(2, 8)


def _eventually(check, seconds: float = 60) -> bool:
    """`check()` became true within `seconds` (what another thread does, seen from the store)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _unique(name: str) -> str:
    return f"{name}-{os.getpid()}-{os.urandom(3).hex()}"


@pytest.fixture
def url(use_store):
    server = use_store("s3")
    return server.url(server.make_bucket(_unique("commit")), "run")


def _backup(directory, position: Position, rank: int) -> bytes:
    """A backup of worker `rank` at `position` in `directory` as write_backup leaves it; returns its weights."""
    import hashlib

    os.makedirs(directory, exist_ok=True)
    weights = f"weights at {position}".encode() * 100
    state = json.dumps({"rank": rank, "position": str(position)}).encode()
    names = {}
    for part, data in ((WEIGHTS, weights), (STATE, state)):
        name = file_name(position, part)
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(data)
        names[name] = hashlib.sha256(data).hexdigest()
    meta = read_metadata(directory)
    write_metadata(directory, {**(meta.backups if meta.state == "ok" else {}), position: names})
    return weights


class Run:
    """One attempt of a 2-worker run: the chief claims it and chooses its base, as `RemoteBackups.decide` does."""

    def __init__(self, url: str, root, workers: int = 2, keep: int = 2) -> None:
        self.store = storage.open_store(url, "backup_dir")
        self.attempt = commit.claim(self.store, workers)
        self.dirs = [str(root / f"g{self.attempt.generation}-worker-{r}") for r in range(workers)]
        chosen, _ = readback.newest_verified(self.store, 0, self.dirs[0], top=self.attempt.generation)
        commit.set_base(self.store, self.attempt, chosen.name if chosen else None)
        self.uploads = [Uploads(self.store, self.attempt, rank=r, is_chief=r == 0, ranks=list(range(workers)),
                                keep=keep, outbox=self.dirs[r] + ".outbox") for r in range(workers)]

    def back_up(self, position: Position, ranks=None) -> None:
        for rank in range(len(self.dirs)) if ranks is None else ranks:
            _backup(self.dirs[rank], position, rank)
            self.uploads[rank].submit(position, position.key, self.dirs[rank])

    def committed(self, position: Position, seconds: float = 60) -> bool:
        return self.uploads[0].wait(position, seconds)

    def close(self) -> None:
        for uploads in self.uploads:
            uploads.close()


def test_a_backup_commits_once_every_part_is_in_and_reads_back_verified(url, tmp_path):
    run = Run(url, tmp_path)
    run.back_up(P1)
    assert run.committed(P1)
    objects = sorted(run.store.list())
    name = commit.backup_name(run.attempt.generation, P1)
    assert f"backups/{name}/{file_name(P1, WEIGHTS)}" in objects          # the weights once, from the chief
    assert [o for o in objects if o.endswith(WEIGHTS)] == [f"backups/{name}/{file_name(P1, WEIGHTS)}"]
    manifest = json.loads(run.store.read_bytes(f"backups/{name}/manifest.json"))
    assert sorted(manifest["files"]) == sorted([file_name(P1, WEIGHTS), f"worker-0/{file_name(P1, STATE)}",
                                                f"worker-1/{file_name(P1, STATE)}"])

    # Worker 1's part of P2 is not in: no commit, the resume point stays P1.
    run.back_up(P2, ranks=[0])
    assert not run.committed(P2, 1.0)
    assert readback.committed_positions(url) == [P1]
    assert find_resume_point(url).position == P1
    run.back_up(P2, ranks=[1])
    assert run.committed(P2)

    # A fresh host reads worker 1's own part (its state), the chief's weights; a new rank gets the chief's state.
    for rank in (1, 5):
        point = remote.read_back(url, str(tmp_path / f"fresh-{rank}"), rank=rank)
        assert point.position == P2 and point.checked and point.source.endswith(commit.backup_name(1, P2))
        assert json.loads(Path(point.files[STATE]).read_text())["rank"] == (1 if rank == 1 else 0)
        assert Path(point.path).read_bytes() == f"weights at {P2}".encode() * 100
    copied = copy_backup(url, str(tmp_path / "copy"))
    assert copied.position == P2 and read_metadata(str(tmp_path / "copy")).latest == P2
    with pytest.raises(ConfigError, match="a store takes backups only through a run's own commit"):
        copy_backup(str(tmp_path / "copy"), url)
    run.close()


def test_what_was_killed_mid_upload_or_damaged_is_never_read(url, tmp_path):
    store = storage.open_store(url, "backup_dir")
    store.write_bytes(f"backups/{commit.backup_name(1, P1)}/{file_name(P1, WEIGHTS)}", b"half")
    point = find_resume_point(url)         # killed in its first upload: nothing to resume, and said
    assert point.position == Position() and "holds no committed backup, only" in point.note
    run = Run(url, tmp_path, workers=1)
    for position in (P1, P2):
        run.back_up(position)
        assert run.committed(position)
    # killed mid-upload: a backup's files without its manifest
    store.write_bytes(f"backups/{commit.backup_name(1, P3)}/{file_name(P3, WEIGHTS)}", b"half")
    assert find_resume_point(url).position == P2
    # damaged: the newest commit's weights differ from the manifest: the one before is used, and said (a host
    # that still holds an intact copy of that file, checked against the manifest, needs no download)
    store.write_bytes(f"backups/{commit.backup_name(1, P2)}/{file_name(P2, WEIGHTS)}", b"garbage")
    assert find_resume_point(url).position == P2
    point = remote.read_back(url, str(tmp_path / "fresh-host"))
    assert point.position == P1 and "is corrupt" in point.note and commit.backup_name(1, P2) in point.note
    # everything damaged: an error that names each, and nothing deleted
    store.remove(f"backups/{commit.backup_name(1, P1)}/worker-0/{file_name(P1, STATE)}")
    before = store.list()
    with pytest.raises(ConfigError, match=r"no committed backup can be used: .*is corrupt.*does not exist.*Nothing "
                                          r"was deleted"):
        remote.read_back(url, str(tmp_path / "another-host"))
    assert store.list() == before
    run.close()


def test_a_leftover_of_an_earlier_attempt_can_neither_commit_nor_delete(url, tmp_path, caplog):
    old = Run(url, tmp_path)
    for position in (P1, P2):
        old.back_up(position)
        assert old.committed(position)
    new = Run(url, tmp_path)                       # a retried attempt: resumes from P2, fences the old one
    assert new.attempt.generation == 2 and new.attempt.base == commit.backup_name(1, P2)
    with caplog.at_level(logging.WARNING, logger="stratkit"):
        old.back_up(P3)                            # the leftover trains on and backs up
        assert not old.committed(P3, 30) and old.uploads[0].fenced == 2
    assert sum("commits and deletes nothing more" in r.getMessage() for r in caplog.records) == 1
    assert commit.backup_name(1, P3) + "/manifest.json" not in " ".join(new.store.list())

    # The race the fence cannot stop: the leftover's commit lands after the new attempt chose its base.
    # Newer than the base, outside the lineage: no reader takes it.
    commit.upload_files(old.store, commit.backup_name(1, P4), [])
    local = [commit.LocalFile(os.path.join(old.dirs[0], file_name(P2, WEIGHTS)), file_name(P4, WEIGHTS), "0" * 64, 1)]
    commit.write_manifest(old.store, old.attempt, commit.backup_name(1, P4), P4, 0, local, [0])
    assert find_resume_point(url).position == P2

    # Its pruning (one begun before it saw the new claim: no fence check) cannot touch the new attempt's backups,
    # and keeps its own newest two, the new attempt's base among them; the new attempt's commits prune the old.
    new.back_up(P3)
    assert new.committed(P3)
    commit.prune(old.store, 1, keep=2)
    assert readback.committed_positions(url) == [P3, P2]
    assert not any(commit.backup_name(1, P1) in key for key in new.store.list())
    new.back_up(P4)
    assert new.committed(P4)
    # generation 1 gone (2 kept), records too: the pruning runs right after the commit, in the uploads' thread
    assert _eventually(lambda: {key.split("/")[1] for key in new.store.list() if key.startswith("backups/")} ==
                       {commit.backup_name(2, P3), commit.backup_name(2, P4)})
    assert _eventually(lambda: not any(key.startswith("attempts/00000001") for key in new.store.list()))
    commit.remove_all(old.store, 1)                 # a finished leftover's removal: its own generation only
    assert readback.committed_positions(url) == [P4, P3]
    old.close()
    new.close()


def test_uploads_go_on_while_the_store_is_down_with_one_warning_and_say_what_never_arrived(use_store, tmp_path,
                                                                                           caplog, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")   # botocore's own retries would hide each failure for ~8 s
    server = use_store("s3")
    url = server.url(server.make_bucket(_unique("down")), "run")
    monkeypatch.setattr("stratkit.training.checkpoint.uploads.RETRY_MAX", 0.5)
    run = Run(url, tmp_path, workers=1)
    run.back_up(P1)
    assert run.committed(P1)
    with caplog.at_level(logging.WARNING, logger="stratkit"):
        server.down()
        try:
            submitted = threading.Event()

            def train():  # the training thread: a submit never waits for the store
                run.back_up(P2)
                run.back_up(P3)
                submitted.set()

            threading.Thread(target=train).start()
            assert submitted.wait(30)
            # (the client retries on its own for a few seconds before an upload fails)
            assert _eventually(lambda: any("uploads are failing" in r.getMessage() for r in caplog.records))
            assert not run.uploads[0].wait(P3, 0.5)
        finally:
            server.up()
        assert run.committed(P3, 60)
        report = run.uploads[0].close()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("uploads are failing" in m for m in messages) == 1, messages     # one warning, not one per retry
    assert any("the newest committed backup is epoch 0 + 7 steps" in m for m in messages)
    assert sum("answers again" in m for m in messages) == 1
    assert report.lost == [P2]  # tried while the store was down, then replaced by P3 (which landed)
    assert readback.committed_positions(url)[0] == P3

    # Down at the end: the run says which backups never reached the store.
    run2 = Run(url, tmp_path / "second", workers=1)
    server.down()
    try:
        run2.back_up(P4)
        report = run2.uploads[0].close(flush=1.0)
    finally:
        server.up()
    assert report.lost == [P4] and "could not be reached" in report.failure and report.reached is None


def test_urls_that_are_local_stay_local_and_hdfs_says_what_it_needs(tmp_path, monkeypatch):
    from stratkit.callbacks import Backup

    assert Backup(f"file://{tmp_path}/b").backup_dir == f"{tmp_path}/b"       # file://: the local directory
    with pytest.raises(ConfigError, match="a s3:// URL with a slash missing|reads as a s3:// URL"):
        Backup("s3:/bucket/run")                                             # never a local directory 's3:'
    monkeypatch.delenv("HADOOP_HOME", raising=False)
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    backup = Backup("hdfs://namenode:8020/runs/run1", is_chief=True, rank=0, staging=str(tmp_path / "staging"))
    with pytest.raises(ConfigError, match=r"hdfs:// filesystem \(pyarrow\).*Java and HADOOP_HOME"):
        backup.decide_position()                                             # before step 1: no server runs here
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))


def test_a_store_that_refuses_or_lacks_is_refused_before_step_1(use_store, monkeypatch, tmp_path):
    """Trainer.fit with backup_dir on a store: a wrong credential, a missing bucket, the store down at the start
    are each a ConfigError naming the fix, before any step (and no credential in the message)."""
    import keras
    import numpy as np

    import stratkit

    server = use_store("s3")
    url = server.url(server.make_bucket(_unique("refused")), "run1")
    trainer = stratkit.Trainer(strategy="one_device")

    def build():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    model = trainer.build(build)
    steps = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: steps.append(batch))
    x = np.zeros((32, 2), "float32")

    def fit(backup_dir: str) -> str:
        with pytest.raises(ConfigError) as caught:
            trainer.fit(model, (x, x[:, :1]), global_batch_size=8, backup_dir=backup_dir, backup_every=2,
                        callbacks=[counter], verbose=0)
        return str(caught.value)

    monkeypatch.setenv("STRATKIT_BACKUP_STAGING", str(tmp_path / "staging"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")   # (the store down: refused at once, not after botocore's retries)
    secret = "wrong-secret-0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    use_store.refresh()
    text = fit(url)
    assert "refused the credentials" in text and "AWS_SECRET_ACCESS_KEY" in text
    assert secret not in text and server.secret not in text
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    use_store.refresh()
    text = fit(server.url(_unique("missing"), "run1"))
    assert "does not exist" in text and "Fix: create it" in text
    server.down()
    try:
        text = fit(url)
    finally:
        server.up()
    assert "could not be reached" in text and "Fix: check the store's endpoint" in text
    assert steps == []                                       # before step 1, every time
    assert not any(p.name.endswith(":") for p in tmp_path.rglob("*"))
