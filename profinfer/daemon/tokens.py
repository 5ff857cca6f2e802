"""The daemon's control token: given, or kept in a file only its owner may read."""
from __future__ import annotations

import os
import secrets
import stat

from ..errors import ProfinferError


def load_token(token: str | None, token_file: str) -> str:
    """The control token: given, or read from token_file, made there (mode 0600) if absent.
    An existing file must be a regular file of ours, readable by nobody else (opened without
    following a link, checked on the open file)."""
    if token:
        return token
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            fd = os.open(token_file, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ProfinferError(f"cannot open the token file {token_file}: {e.strerror}") from None
        with os.fdopen(fd) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise ProfinferError(f"{token_file} is not a regular file of this user's") from None
            if st.st_mode & 0o077:
                raise ProfinferError(f"{token_file} is readable by others (mode {st.st_mode & 0o777:o}): "
                                     "chmod 600 it") from None
            value = f.read().strip()
        if not value:
            raise ProfinferError(f"{token_file} is empty") from None
        return value
    except OSError as e:
        raise ProfinferError(f"cannot make the token file {token_file}: {e.strerror}") from None
    value = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
