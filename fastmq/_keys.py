"""Where the remote path's keys come from, and the per-connection handshake
that hands each reader the queue's message key.

Two roots of trust (the threat model: docs/operations.md, "Security"):

* **a deployment secret** (``FASTMQ_SECRET``, or a file named by
  ``FASTMQ_SECRET_FILE``), the same on every node and given out of band.
  Each queue's pre-shared key is HKDF-SHA256(secret, salt), with a fresh
  16-byte salt per queue that travels in the ``Handle``: the handle then
  holds no key, and whoever saw how handles were handed out learns
  nothing;
* **without one**, a fresh random 32-byte key per queue that travels in the
  ``Handle`` (``remote_key``): authentic against everyone who did not see
  the channel that hands handles to readers.

The pre-shared key only authenticates the handshake; no message is sealed
under it.  Each connection agrees a key of its own (X25519, both sides'
key pairs fresh and forgotten once the handshake is over); the writer sends
the queue's message key (random per queue, never derived from anything
that crosses the wire) wrapped under it.  So someone who only recorded the
setup traffic, or a whole session, cannot read or forge later traffic,
even if the pre-shared key is learnt afterwards (forward secrecy); someone
who holds the pre-shared key *and* sits on the path during the handshake
can (a man in the middle), which is why the deployment secret exists.

Handshake, on each connection (``fastmq._wire`` has the formats)::

    writer -> reader  CHALLENGE  writer nonce, writer public key
    reader -> writer  HELLO      rank, pid, reader nonce, reader public key,
                                 proof = HMAC(handshake key, "reader" | CHALLENGE | HELLO)
    writer -> reader  READY      AES-GCM(connection key, message key, aad=CHALLENGE | HELLO)

connection key = HKDF(X25519(...), salt = handshake key, info = the
transcript's hash): a reader that cannot prove the pre-shared key never
gets READY; a writer that does not hold it cannot make a READY that opens.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import shlex
import stat
import types

from fastmq import _seal

logger = logging.getLogger("fastmq")

KEY_BYTES = 32
SALT_BYTES = 16
KEY_ID_BYTES = 8
NONCE_BYTES = 16        # each side's handshake nonce
PUBLIC_BYTES = 32       # an X25519 public key
PROOF_BYTES = 32        # HMAC-SHA256
WRAPPED_BYTES = KEY_BYTES + 16   # the message key and its GCM tag
MIN_SECRET_BYTES = 16

SECRET_ENV = "FASTMQ_SECRET"
SECRET_FILE_ENV = "FASTMQ_SECRET_FILE"

_logged_trust = False


def _crypto():
    """``cryptography``'s pieces, imported when first needed (``import
    fastmq`` stays light), as one namespace."""
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric.x25519 import (X25519PrivateKey,
                                                                      X25519PublicKey)
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:
        raise RuntimeError("fastmq: the remote path's security needs the 'cryptography' "
                           "package (pip install cryptography)") from e
    return types.SimpleNamespace(hashes=hashes, serialization=serialization,
                                 X25519PrivateKey=X25519PrivateKey,
                                 X25519PublicKey=X25519PublicKey, AESGCM=AESGCM, HKDF=HKDF)


def hkdf(ikm: bytes, salt: bytes | None, info: bytes, length: int = KEY_BYTES) -> bytes:
    c = _crypto()
    return c.HKDF(algorithm=c.hashes.SHA256(), length=length, salt=salt,
                  info=info).derive(ikm)


def deployment_secret() -> bytes | None:
    """The deployment secret from ``FASTMQ_SECRET`` or the file that
    ``FASTMQ_SECRET_FILE`` names (not both), or None; a clear ``ValueError``
    for an empty, short or unreadable one."""
    value = os.environ.get(SECRET_ENV)
    path = os.environ.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise ValueError(f"fastmq: both {SECRET_ENV} and {SECRET_FILE_ENV} are set; set one")
    if path is not None:
        secret = read_secret_file(path).strip()
        where = f"the file {SECRET_FILE_ENV}={path!r}"
    elif value is not None:
        secret, where = value.strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"fastmq: the deployment secret in {where} is {len(secret)} bytes; "
                         f"it must be at least {MIN_SECRET_BYTES} (for example the output of "
                         "`openssl rand -hex 32`)")
    return secret


# A symlink is followed at most this many times (the kernel's own limit).
_MAX_LINKS = 40


def _trusted_owner(uid: int) -> bool:
    # Root owns what the kernel, the image or an orchestrator put in place
    # (a Kubernetes secret volume's links and files, with fsGroup unset).
    return uid in (os.geteuid(), 0)


def _unreadable(path: str, e: Exception) -> ValueError:
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return ValueError(f"fastmq: {SECRET_FILE_ENV}={path!r} cannot be read: {why}")


def _refused(path: str, why: str, fix: str) -> ValueError:
    return ValueError(f"fastmq: {SECRET_FILE_ENV}={path!r} {why}, so fastmq does not use "
                      f"the deployment secret in it. {fix}")


def read_secret_file(path: str) -> bytes:
    """The bytes of the secret file ``path``, refused (``ValueError`` naming
    the file and what to change) unless only its owner may read it, as ssh
    refuses a private key: the file is a regular file owned by this
    process's (effective) user or by root, with no group or other
    permission bit, and the name, if a symlink, and each symlink it leads
    through to the file are owned by this user or by root.  Anyone else
    who could read the secret could pose as any writer or reader of every
    queue; anyone who could write it, or retarget a link to it, could
    choose it."""
    where = path
    for _ in range(_MAX_LINKS):
        try:
            st = os.lstat(where)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(where)
        except (OSError, ValueError) as e:      # ValueError: a NUL in the name
            raise _unreadable(path, e) from None
        if not stat.S_ISLNK(st.st_mode):
            break
        if not _trusted_owner(st.st_uid):
            raise _refused(path, f"is reached through the symlink {where!r}, owned by uid "
                           f"{st.st_uid}, which may point it anywhere",
                           "Name the file itself, or a link owned by this user or root.")
        where = os.path.join(os.path.dirname(where), target)
    else:
        raise _unreadable(path, OSError(errno.ELOOP, f"more than {_MAX_LINKS} symlinks"))
    try:
        # O_NOFOLLOW: the links were checked above, and one swapped in since
        # is refused rather than followed.  O_NONBLOCK: a FIFO planted there
        # must not hang the process; it is refused below.
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _unreadable(path, e) from None
    try:
        st = os.fstat(fd)
        # What to change is the file itself, wherever the name points.
        file = shlex.quote(where)
        it = "it" if where == path else f"the file it points to, {where!r},"
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, "is not a regular file" if where == path else
                           f"points to {where!r}, which is not a regular file",
                           "Put the secret in a regular file.")
        if not _trusted_owner(st.st_uid):
            raise _refused(path, f"{'is' if where == path else 'points to a file'} owned by "
                           f"uid {st.st_uid}, not by this process's user (uid "
                           f"{os.geteuid()}) or root",
                           f"Give {it} to this user: `chown {os.geteuid()} {file}`.")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            acts = [a for a, bits in (("read", 0o044), ("write", 0o022), ("execute", 0o011))
                    if mode & bits]
            raise _refused(path, f"{'has' if where == path else 'points to a file with'} "
                           f"mode {mode:04o}: users other than its owner may "
                           f"{' and '.join(acts)} it",
                           f"Make {it} readable by its owner only: `chmod 600 {file}`.")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError as e:
        raise _unreadable(path, e) from None
    finally:
        os.close(fd)


def _key_id(psk: bytes) -> bytes:
    return hmac.digest(psk, b"fastmq queue key id", "sha256")[:KEY_ID_BYTES]


def new_writer_trust(security: str) -> dict:
    """The writer's root of trust for a new queue: ``psk`` (None in
    ``"none"``) and the handle fields that let a reader find the same key."""
    if security == "none":
        return {"psk": None, "remote_key": None, "remote_salt": None, "remote_key_id": None}
    secret = deployment_secret()
    _log_trust(secret is not None)
    if secret is None:
        psk = secrets.token_bytes(KEY_BYTES)
        return {"psk": psk, "remote_key": psk, "remote_salt": None, "remote_key_id": None}
    salt = secrets.token_bytes(SALT_BYTES)
    psk = hkdf(secret, salt, b"fastmq queue pre-shared key")
    return {"psk": psk, "remote_key": None, "remote_salt": salt, "remote_key_id": _key_id(psk)}


def reader_psk(handle, security: str) -> bytes | None:
    """The pre-shared key a remote reader of ``handle`` proves it holds.

    A process that holds the deployment secret refuses a handle that does
    not use it (plain TCP, or a key of its own in the handle): the secret
    is there so that nothing a reader believes comes from the network, and
    a handle changed on the way could otherwise point the reader at any
    writer.  Plain TCP stays possible where this process asks for it too
    (``FASTMQ_REMOTE_SECURITY=none``)."""
    salt = getattr(handle, "remote_salt", None)
    if (security == "none" or salt is None) and deployment_secret() is not None:
        if security == "none":
            if _seal.mode(None) != "none":
                raise RuntimeError(
                    f"fastmq: the queue's handle asks for plain, unauthenticated TCP (remote "
                    f"security 'none'), but this process has a deployment secret "
                    f"({SECRET_ENV}): a handle changed on its way could point this reader at "
                    "any writer.  Set FASTMQ_REMOTE_SECURITY=none in this process too if "
                    "plain TCP is meant")
        else:
            raise RuntimeError(
                f"fastmq: this process has a deployment secret ({SECRET_ENV}), but the "
                "queue's writer did not derive its key from one (the key travels in the "
                "handle): a handle changed on its way could point this reader at any writer.  "
                f"Set {SECRET_ENV} (or {SECRET_FILE_ENV}) in the writer's process too")
    if security == "none":
        return None
    if salt is None:
        key = getattr(handle, "remote_key", None)
        if key is None or len(key) != KEY_BYTES:
            raise ValueError(f"fastmq: remote security {security!r} needs a {KEY_BYTES}-byte "
                             "key or a deployment secret's salt in the handle")
        return key
    secret = deployment_secret()
    if secret is None:
        raise RuntimeError(
            f"fastmq: this queue's writer derives its keys from a deployment secret, and "
            f"this process has none: set {SECRET_ENV} (or {SECRET_FILE_ENV}) to the "
            "writer's value")
    psk = hkdf(secret, salt, b"fastmq queue pre-shared key")
    if not hmac.compare_digest(_key_id(psk), getattr(handle, "remote_key_id", b"") or b""):
        raise RuntimeError(
            f"fastmq: the deployment secret in this process ({SECRET_ENV} / "
            f"{SECRET_FILE_ENV}) is not the one the queue's writer uses: set the same "
            "value on every node")
    return psk


def _log_trust(with_secret: bool) -> None:
    global _logged_trust
    if _logged_trust:
        return
    _logged_trust = True
    if with_secret:
        logger.info("fastmq: remote readers are authenticated with keys derived from the "
                    "deployment secret (%s / %s); no key travels in a queue's handle",
                    SECRET_ENV, SECRET_FILE_ENV)
    else:
        logger.warning(
            "fastmq: remote readers are authenticated with a key that travels in the "
            "queue's handle: secure against anyone who did not see the traffic that hands "
            "out handles (vLLM's process group, not encrypted) and against anyone who only "
            "recorded it, but not against someone who saw it and sits between the nodes "
            "during the handshake. Set %s (or %s, a file) to the same random value on every "
            "node, e.g. `openssl rand -hex 32`, so that no key crosses the network",
            SECRET_ENV, SECRET_FILE_ENV)


class Handshake:
    """One connection's side of the handshake under pre-shared key ``psk``
    (None: security ``"none"``, where nothing is proven and the fields are
    zeros)."""

    def __init__(self, psk: bytes | None):
        self.psk = psk
        self.nonce = os.urandom(NONCE_BYTES)
        if psk is None:
            self._private = None
            self.public = bytes(PUBLIC_BYTES)
            self._hs_key = None
            return
        c = _crypto()
        self._private = c.X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(
            c.serialization.Encoding.Raw, c.serialization.PublicFormat.Raw)
        self._hs_key = hkdf(psk, None, b"fastmq handshake")

    def prove(self, role: bytes, transcript: bytes) -> bytes:
        if self._hs_key is None:
            return bytes(PROOF_BYTES)
        return hmac.digest(self._hs_key, role + transcript, "sha256")

    def proven(self, proof, role: bytes, transcript: bytes) -> bool:
        if self._hs_key is None:
            return True
        return hmac.compare_digest(bytes(proof), self.prove(role, transcript))

    def _connection_key(self, peer_public: bytes, transcript: bytes) -> bytes:
        try:
            shared = self._private.exchange(
                _crypto().X25519PublicKey.from_public_bytes(peer_public))
        except ValueError:   # a low-order point: no shared secret
            return b""
        self._private = None   # forgotten: forward secrecy
        return hkdf(shared, self._hs_key,
                    b"fastmq connection " + hashlib.sha256(transcript).digest())

    def wrap(self, message_key: bytes | None, peer_public: bytes, transcript: bytes) -> bytes:
        """The writer's READY field: ``message_key`` under this connection's key."""
        if self._hs_key is None:
            return bytes(WRAPPED_BYTES)
        key = self._connection_key(peer_public, transcript)
        if not key:
            raise ValueError("the reader's public key is not usable")
        # This connection's key seals exactly one message: a fixed nonce.
        return _crypto().AESGCM(key).encrypt(bytes(12), message_key, transcript)

    def unwrap(self, wrapped, peer_public: bytes, transcript: bytes) -> bytes | None:
        """The reader's side of ``wrap``: the message key, or None if READY
        was not made by a holder of the pre-shared key."""
        if self._hs_key is None:
            return None
        from cryptography.exceptions import InvalidTag

        key = self._connection_key(peer_public, transcript)
        if not key:
            return None
        try:
            return _crypto().AESGCM(key).decrypt(bytes(12), bytes(wrapped), transcript)
        except InvalidTag:
            return None


def new_message_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)
