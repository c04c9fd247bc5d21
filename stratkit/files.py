"""Files stratkit keeps for the user (backups, markers): whose they are, and how they are written.

One place for the rules every writer of a backup directory follows (the
`Trainer` backup, the parameter-server chief, the sidecar evaluator, the
ps/worker done markers). It sits below every layer (standard library and
`stratkit.errors` only), so the strategy layer's done markers
(`stratkit.strategy.server`) and the training layer's backups share it
without the strategy layer importing the training layer:

  * a directory is used only if it (and the symlink leading to it, if any)
    belongs to this user (or to root, when not writable by everyone): a path in a
    shared temp directory that another user created or redirected is refused
    with a `ConfigError`, never followed;
  * a file is read only if it is not a symlink and belongs to this user;
  * a file is written under a fresh temporary name created exclusively
    (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600), fsynced, renamed over the
    final name (a rename replaces a planted symlink instead of following it),
    and the directory is fsynced: a reader sees the old file or the new one,
    never half of one;
  * temporaries are named `.stratkit-tmp-<host>-<pid>-<random>`, so a later
    start can remove the ones whose writer died (`kill -9`) and only those.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from typing import Callable

from stratkit.errors import ConfigError

TEMP_PREFIX = ".stratkit-tmp-"
_TEMP_NAME = re.compile(r"^\.stratkit-tmp-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-[A-Za-z0-9_-]+(\..*)?$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname() or "host")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _trusted_owner(info: os.stat_result) -> bool:
    """This user, or root for a directory only root and this user can change."""
    return info.st_uid == os.geteuid() or (info.st_uid == 0 and not info.st_mode & stat.S_IWOTH)


def check_dir(path: str, what: str, *, create: bool = True, private: bool = False) -> str:
    """Make sure `path` is a directory this user controls (creating it, mode 0700, if missing).

    Args:
        path: the directory.
        what: how the user named it, for the error (e.g. "backup_dir").
        create: create it (and its parents) if it does not exist.
        private: also require mode 0700-or-stricter and no symlink at all (for
            directories only stratkit ever reads, such as the done markers').

    Raises:
        ConfigError: a symlink someone else made, a directory someone else owns, a
            directory everybody can write to, or (private) one others can read.
    """
    path = os.fspath(path)
    try:
        link = os.lstat(path)
    except FileNotFoundError:
        if not create:
            raise
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # created by someone else in between: check what it is
            pass
        link = os.lstat(path)
    fix = f"Fix: pass {what}=<a directory of your own>, or remove {path!r} if it is left over"
    if stat.S_ISLNK(link.st_mode):
        if private or link.st_uid != os.geteuid():
            whose = "" if link.st_uid == os.geteuid() else f" made by {_owner(link.st_uid)}"
            raise ConfigError(f"{what}={path!r} is a symlink{whose} (to {os.readlink(path)!r}); stratkit does not "
                              f"follow it, so nobody can redirect its files. {fix}")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{what}={path!r} is a dangling symlink. {fix}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what}={path!r} exists and is not a directory. {fix}")
    if not _trusted_owner(info):
        problem = (f"is owned by {_owner(info.st_uid)}, not by you ({_owner(os.geteuid())})"
                   if info.st_uid != os.geteuid() and info.st_uid != 0 else
                   "is writable by every user (a shared temp directory)")
        raise ConfigError(f"{what}={path!r} {problem}: another user could read or replace its files. {fix}")
    if private and info.st_mode & 0o077:
        raise ConfigError(f"{what}={path!r} has mode {stat.S_IMODE(info.st_mode):04o}; it must be private (0700). "
                          f"Fix: chmod 700 {path!r}, or remove it (stratkit recreates it)")
    return path


def check_file(path: str, what: str) -> None:
    """Refuse to read `path` if it is a symlink or someone else's file (missing is fine)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(f"{path!r} in {what} is a symlink; stratkit never writes one there, so someone else made "
                          f"it. Fix: remove {path!r} and check who can write to that directory")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{path!r} in {what} is owned by {_owner(info.st_uid)}, not by you: stratkit did not "
                          f"write it. Fix: remove {path!r} and check who can write to that directory")


def read_bytes(path: str, what: str, limit: int = 1 << 20) -> bytes:
    """The content of a small file of ours; not through a symlink, not someone else's.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: a symlink, someone else's file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            check_file(path, what)
        raise
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            check_file(path, what)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(limit)
    finally:
        os.close(fd)


def _create_exclusive(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


def temp_name(suffix: str = "") -> str:
    """A fresh temporary name in our pattern (host and pid say who may still be writing it)."""
    return f"{TEMP_PREFIX}{_host()}-{os.getpid()}-{os.urandom(6).hex()}{suffix}"


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def write_bytes(path: str, data: bytes) -> None:
    """Replace `path` with `data` atomically: exclusive temp file, fsync, rename, fsync the directory."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, temp_name())
    fd = _create_exclusive(tmp)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    fsync_dir(directory)


def write_with(path: str, write: Callable[[str], None]) -> None:
    """Replace `path` with what `write(temp_path)` writes (for writers that only take a path, e.g. Keras).

    The writer gets a path inside a private directory created for it (mkdtemp,
    0700), where no one else can place or swap a file; the finished file is
    fsynced and renamed into place.
    """
    directory, name = os.path.split(os.path.abspath(path))
    scratch = tempfile.mkdtemp(prefix=temp_name() + "-", dir=directory)
    try:
        tmp = os.path.join(scratch, name)
        os.close(_create_exclusive(tmp))
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def replace_dir_with(path: str, write: Callable[[str], None]) -> None:
    """Replace the directory `path` with what `write(temp_path)` writes (e.g. a SavedModel export).

    The writer fills a fresh directory beside `path` (in a private mkdtemp); the
    old directory, if any, is renamed away and the new one renamed in, so
    `path` is always a whole old or a whole new tree (never a mix; for an
    instant between the two renames, absent), and the old one is removed after.
    """
    directory, name = os.path.split(os.path.abspath(path))
    scratch = tempfile.mkdtemp(prefix=temp_name() + "-", dir=directory)
    try:
        new = os.path.join(scratch, name)
        write(new)
        for attempt in range(20):   # another writer (a worker saving the same export) may move in between
            if os.path.lexists(path):
                try:
                    os.rename(path, os.path.join(scratch, f"old-{attempt}"))
                except FileNotFoundError:
                    pass
            try:
                os.rename(new, path)
                break
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == 19:
                    raise
        fsync_dir(directory)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def sha256(path: str) -> str:
    """The SHA-256 of the file `path`, in hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def clean_stale_temporaries(directory: str) -> list[str]:
    """Remove temporaries in `directory` left by a writer that died, and return their names.

    Only names in our pattern, written on this host by a process that no longer
    exists (a temporary from another host may still be being written: left alone).
    Call it only for a directory this process alone writes (each worker its own).
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    host = _host()
    for name in names:
        match = _TEMP_NAME.match(name)
        if not match or match["host"] != host or int(match["pid"]) == os.getpid() or _alive(int(match["pid"])):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            remove(path)
        removed.append(name)
    return removed
