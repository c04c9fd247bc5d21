"""`stratkit.storage.Mirror` (a staging directory kept in step with a store prefix) and what the callers of the
store layer need of it: uploads of what a writer made, local copies of a prefix, whether a filesystem is there.

Against a local directory and moto's S3 server (the mirror speaks only `Store`; `test_store.py` covers every
backend of that)."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from stratkit import storage
from stratkit.storage.mirror import MANIFEST, Mirror

PAIR = ("latest.weights.h5", "training_metadata.json")


@pytest.fixture(params=["local", "s3"])
def root(request, use_store, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    server = use_store("s3")
    return server.url(server.make_bucket(f"mirror-{os.getpid()}-{os.urandom(3).hex()}"), "backup")


def _write(directory, name, data):
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def _epoch(directory, epoch, double=True):
    """What Keras's BackupAndRestore does at an epoch's end: the pair to .bkp (double checkpoint), a new pair."""
    for name in PAIR:
        if double and os.path.exists(os.path.join(directory, name)):
            os.replace(os.path.join(directory, name), os.path.join(directory, name + ".bkp"))
    _write(directory, PAIR[0], f"weights {epoch}".encode())
    _write(directory, PAIR[1], json.dumps({"epoch": epoch}).encode())


def _read(directory, name):
    with open(os.path.join(directory, name), "rb") as handle:
        return handle.read()


def test_push_uploads_what_changed_and_deletes_only_its_own_files(root, tmp_path):
    store = storage.open_store(root)
    store.write_bytes("someone-elses.txt", b"keep me")
    local = str(tmp_path / "staging")
    mirror = Mirror(local, store)
    _write(local, "a/one.txt", b"1")
    _write(local, "two.txt", b"2")
    assert sorted(mirror.push()) == ["a/one.txt", "two.txt"]
    assert mirror.push() == []                              # nothing changed: nothing uploaded
    _write(local, "two.txt", b"22")
    assert mirror.push() == ["two.txt"]
    os.remove(os.path.join(local, "a", "one.txt"))
    mirror.push()
    assert store.list() == ["someone-elses.txt", "two.txt"] and store.read_bytes("two.txt") == b"22"


def test_a_push_cut_short_is_read_back_as_the_last_complete_one(root, tmp_path, caplog):
    local = str(tmp_path / "chief")
    mirror = Mirror(local, storage.open_store(root), manifest=True, last=PAIR)
    _epoch(local, 1)
    mirror.push()
    _epoch(local, 2)
    mirror.push()
    assert storage.open_store(root).exists(MANIFEST)
    # Epoch 3's push dies after the .bkp files and the new weights, before the epoch file and the manifest.
    store = storage.open_store(root)
    store.write_bytes(PAIR[0] + ".bkp", b"weights 2")
    store.write_bytes(PAIR[1] + ".bkp", json.dumps({"epoch": 2}).encode())
    store.write_bytes(PAIR[0], b"weights 3")
    again = str(tmp_path / "restart")
    Mirror(again, storage.open_store(root), manifest=True, last=PAIR).pull()
    assert _read(again, PAIR[0]) == b"weights 2" and json.loads(_read(again, PAIR[1])) == {"epoch": 2}

    # Without Keras's double checkpoint there is no committed copy left: kept as it is, and said.
    bare = str(tmp_path / "bare")
    mirror = Mirror(bare, storage.open_store(storage.join(root, "bare")), manifest=True, last=PAIR)
    _epoch(bare, 1, double=False)
    mirror.push()
    storage.open_store(storage.join(root, "bare")).write_bytes(PAIR[0], b"weights 2")
    with caplog.at_level(logging.WARNING, logger="stratkit.storage.mirror"):
        Mirror(str(tmp_path / "bare-restart"), storage.open_store(storage.join(root, "bare")), manifest=True,
               last=PAIR).pull()
    assert "latest.weights.h5 is newer than the last complete upload" in caplog.text


def test_a_removed_staging_directory_removes_the_objects_and_the_manifest(root, tmp_path):
    local = str(tmp_path / "staging")
    mirror = Mirror(local, storage.open_store(root), manifest=True, last=PAIR)
    _epoch(local, 1)
    mirror.push()
    for name in os.listdir(local):
        os.remove(os.path.join(local, name))
    os.rmdir(local)                                         # BackupAndRestore(delete_checkpoint=True) at the end
    mirror.push()
    assert storage.open_store(root).list() == []


def test_what_a_writer_makes_is_uploaded_its_own_file_last_and_read_back_as_a_directory(root):
    def sharded(tmp):   # Keras's sharded save_weights: the index, its shards beside it
        _write(os.path.dirname(tmp), "model_00000.weights.h5", b"shard")
        _write(os.path.dirname(tmp), os.path.basename(tmp), b"index")

    storage.write_with(storage.join(root, "w", "model.weights.json"), sharded)
    assert storage.open_store(storage.join(root, "w")).list() == ["model.weights.json", "model_00000.weights.h5"]

    def export(tmp):
        _write(tmp, "variables/variables.index", b"v")
        _write(tmp, "saved_model.pb", b"pb")

    storage.replace_dir_with(storage.join(root, "export"), export)
    with storage.local_copy(storage.join(root, "export")) as path:
        assert sorted(os.listdir(path)) == ["saved_model.pb", "variables"]
    if storage.is_url(root):
        with pytest.raises(FileNotFoundError), storage.local_copy(storage.join(root, "nothing-here.keras")):
            pass
    with storage.open_store(storage.join(root, "w")).open("model_00000.weights.h5") as handle:
        handle.seek(2)
        assert handle.read() == b"ard"


def test_has_filesystem_says_whether_a_urls_package_is_there(monkeypatch):
    assert storage.has_filesystem("/a/b") and storage.has_filesystem("file:///a") and storage.has_filesystem("s3://b/x")
    assert not storage.has_filesystem("ram://b/x")          # TensorFlow's, not fsspec's
    monkeypatch.setitem(sys.modules, "gcsfs", None)         # not installed
    assert not storage.has_filesystem("gs://b/x")
