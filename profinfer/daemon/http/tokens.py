"""The daemon's control token: from the environment (PROFINFER_TOKEN), or kept in a file only
its owner may read, made there at the first start."""
from __future__ import annotations

import os
import secrets
import stat

from profinfer.core.base import config
from profinfer.core.base.errors import ProfinferError

TOKEN_ENV = config.TOKEN
TOKEN_MAX_BYTES = 4096           # a token is one short line: a file past this is not one


def load_token(token: str | None, token_file: str, warn=lambda msg: None) -> str:
    """The control token: given, or read from token_file, made there (mode 0600) if absent.
    An existing file must be a regular file of ours, readable by nobody else (opened without
    following a link, checked on the open file). An empty one of ours with mode 0600 is what
    an earlier version left when it crashed while writing: it is replaced (warned)."""
    if token:
        return token
    for _ in range(3):        # another start may make or replace the file at the same time
        try:
            return _read(token_file)
        except FileNotFoundError:
            pass
        except _Empty:
            warn(f"{token_file} is empty (left by a crash while it was written): a new token replaces it")
            try:
                os.unlink(token_file)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise ProfinferError(f"cannot replace the empty token file {token_file}: {e.strerror}") from None
        value = secrets.token_urlsafe(32)
        try:
            _make(token_file, value)
            return value
        except FileExistsError:
            continue
        except OSError as e:
            raise ProfinferError(f"cannot make the token file {token_file}: {e.strerror}") from None
    raise ProfinferError(f"{token_file} keeps changing while it is read: is another daemon starting?")


class _Empty(Exception):
    pass


def _read(token_file: str) -> str:
    try:
        fd = os.open(token_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ProfinferError(f"cannot open the token file {token_file}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ProfinferError(f"{token_file} is not a regular file of this user's")
        if st.st_mode & 0o077:
            raise ProfinferError(f"{token_file} is readable by others (mode {st.st_mode & 0o777:o}): "
                                 "chmod 600 it")
        value = f.read().strip()
    if not value:
        raise _Empty()
    return value


def _make(token_file: str, value: str) -> None:
    """Write the whole token, then give it its name (a crash leaves no file, never an empty
    one): an unnamed file (O_TMPFILE) linked into place, else a named one in the same
    directory. FileExistsError when the name is taken meanwhile."""
    name = os.path.basename(token_file)
    dir_fd = os.open(os.path.dirname(os.path.abspath(token_file)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fd, temp = os.open(".", os.O_TMPFILE | os.O_WRONLY, 0o600, dir_fd=dir_fd), None
        except OSError:          # a filesystem without O_TMPFILE
            temp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)              # whatever the umask
            os.write(fd, (value + "\n").encode())
            os.fsync(fd)
            # never replaces (EEXIST); a dst_dir_fd makes it linkat(AT_SYMLINK_FOLLOW), which
            # links the open file itself through /proc/self/fd
            if temp is None:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
            else:
                os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
        finally:
            os.close(fd)
            if temp is not None:
                os.unlink(temp, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
