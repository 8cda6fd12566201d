"""``FASTMQ_SECRET_FILE`` is refused, as ssh refuses a private key, unless
only its owner may read it: any local user who reads the deployment secret
can pose as any writer or reader of every queue (fastmq/_keys.py)."""
from __future__ import annotations

import os
import re
import threading

import pytest

from fastmq import MessageQueue, _keys

SECRET = b"a deployment secret of enough length"
NOBODY = 65534


@pytest.fixture(autouse=True)
def _only_the_file(monkeypatch):
    monkeypatch.delenv(_keys.SECRET_ENV, raising=False)
    monkeypatch.delenv(_keys.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("FASTMQ_REMOTE_SECURITY", raising=False)


def _secret_file(tmp_path, mode: int, name: str = "secret"):
    path = tmp_path / name
    path.write_bytes(SECRET + b"\n")
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode, may", [
    pytest.param(mode, may, id=f"{mode:04o}")
    for mode, may in ((0o644, "read"), (0o666, "read and write"), (0o640, "read"),
                      (0o604, "read"), (0o620, "write"), (0o610, "execute"))])
def test_a_file_others_may_use_is_refused_naming_it_and_the_fix(monkeypatch, tmp_path,
                                                                mode, may):
    path = _secret_file(tmp_path, mode)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(path))
    expected = (f"FASTMQ_SECRET_FILE='{path}' has mode {mode:04o}: users other than its "
                f"owner may {may} it")
    with pytest.raises(ValueError, match=re.escape(expected)) as e:
        _keys.deployment_secret()
    assert f"`chmod 600 {path}`" in str(e.value)
    # Nothing that would use the secret goes on with it: a writer with a
    # remote reader refuses to start.
    with pytest.raises(ValueError, match=re.escape(expected)):
        MessageQueue(1, 0, connect_ip="127.0.0.1")


@pytest.mark.parametrize("mode", [pytest.param(m, id=f"{m:04o}") for m in (0o600, 0o400)])
def test_an_owner_only_file_is_used(monkeypatch, tmp_path, mode):
    path = _secret_file(tmp_path, mode)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(path))
    assert _keys.deployment_secret() == SECRET
    w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    try:
        h = w.export_handle()
        assert h.remote_key is None and h.remote_salt is not None
    finally:
        w.shutdown()


def test_a_file_of_another_user_is_refused(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another uid (chown) needs root")
    path = _secret_file(tmp_path, 0o600)
    os.chown(path, NOBODY, NOBODY)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(path))
    with pytest.raises(ValueError, match=re.escape(
            f"FASTMQ_SECRET_FILE='{path}' is owned by uid {NOBODY}, not by this process's "
            f"user (uid {os.geteuid()}) or root")) as e:
        _keys.deployment_secret()
    assert f"`chown {os.geteuid()} {path}`" in str(e.value)


def test_a_symlink_to_a_file_of_another_user_is_refused(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another uid (chown) needs root")
    target = _secret_file(tmp_path, 0o600, "theirs")
    os.chown(target, NOBODY, NOBODY)
    link = tmp_path / "secret"
    link.symlink_to(target)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(link))
    with pytest.raises(ValueError, match=re.escape(
            f"FASTMQ_SECRET_FILE='{link}' points to a file owned by uid {NOBODY}")) as e:
        _keys.deployment_secret()
    assert repr(str(target)) in str(e.value)


def test_a_symlink_another_user_owns_is_refused(monkeypatch, tmp_path):
    """Whoever owns the link may point it at a file of their choosing (or
    at another file of this user's): the secret's name must be this user's
    or root's all the way."""
    if os.geteuid() != 0:
        pytest.skip("making a symlink owned by another uid (lchown) needs root")
    target = _secret_file(tmp_path, 0o600, "mine")
    link = tmp_path / "secret"
    link.symlink_to(target)
    os.lchown(link, NOBODY, NOBODY)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(link))
    with pytest.raises(ValueError, match=re.escape(
            f"FASTMQ_SECRET_FILE='{link}' is reached through the symlink '{link}', owned "
            f"by uid {NOBODY}")):
        _keys.deployment_secret()


def test_symlinks_this_user_owns_are_followed_and_the_file_checked(monkeypatch, tmp_path):
    """Kubernetes mounts a secret as links (name -> ..data/name, ..data ->
    a dated folder), all root's: those are fine; the file at the end is
    what is checked."""
    dated = tmp_path / "..2026_01_01"
    dated.mkdir()
    target = _secret_file(dated, 0o400)
    (tmp_path / "..data").symlink_to(dated.name)
    (tmp_path / "secret").symlink_to("..data/secret")
    chain = tmp_path / "link-to-link"
    chain.symlink_to(tmp_path / "secret")
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(chain))
    assert _keys.deployment_secret() == SECRET
    os.chmod(target, 0o644)
    with pytest.raises(ValueError, match=r"points to a file with mode 0644.*`chmod 600 "):
        _keys.deployment_secret()


def test_what_is_not_a_regular_file_is_refused_without_blocking(monkeypatch, tmp_path):
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(fifo))
    got = []

    def read():
        try:
            _keys.deployment_secret()
        except ValueError as e:
            got.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        # Opening the FIFO blocks until a writer comes: be that writer, so
        # that the thread ends, and fail.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("reading FASTMQ_SECRET_FILE blocked on a FIFO")
    assert len(got) == 1 and (f"FASTMQ_SECRET_FILE='{fifo}' is not a regular file"
                              in str(got[0])), got
    monkeypatch.setenv(_keys.SECRET_FILE_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="is not a regular file"):
        _keys.deployment_secret()
