"""Authentication (and, as an option, encryption) of the remote path.

The threat model: docs/operations.md, "Security".

Each queue that has remote readers draws a fresh 32-byte secret; it travels
in the ``Handle`` (``remote_key``, left out of ``repr``) over the channel
that already hands handles to readers (the process group), and lives only
in memory.  From it, two keys:

* the handshake key (HMAC-SHA256): a reader proves it holds the secret by
  answering the writer's fresh challenge, and the writer proves it back by
  signing both sides' nonces, so neither a stranger on the port nor a
  stranger posing as the writer gets in;
* the message key (AES-256-GCM): every message is sealed, its header and
  each segment of its frames, under a nonce made of the message's sequence
  number and the segment's index.  A reader checks every tag before it
  uses what it covers, and takes sequence numbers only in order, so nothing
  can be injected, changed, reordered or replayed.

Security modes (``remote_security=`` or ``FASTMQ_REMOTE_SECURITY``):

* ``"mac"`` (default): authenticated, not encrypted.  The tag is GMAC, the
  payload being GCM's associated data: one more pass over the bytes on
  each side, on the CPU's carry-less multiply (about 24 GB/s a core here),
  and about 0.15 us a side for a 1 KiB message.  The tags
  come from ``fastmq._gmac`` with the key's state kept (fastmq's own code
  on the CPU's AES and carry-less multiply instructions; else the
  process's libcrypto, with large segments through ``cryptography``,
  whose OpenSSL hashes long runs faster than an older system one), else
  from ``cryptography``; the tags are the same whichever computes them.
* ``"encrypt"``: AES-256-GCM, confidentiality too, at about memcpy speed
  (the payload is copied once more on each side).
* ``"none"``: plain TCP, as vLLM's remote readers; anyone who reaches the
  port can read the stream, and be taken for a reader.

GCM fails open if a nonce is ever reused under one key; here the message
key seals only messages of one queue, each under its own sequence number,
and segment index (the header has an index of its own), so no nonce
repeats.  The handshake uses HMAC, which has no nonce to repeat.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import struct

from fastmq._gmac import Gmac, available as gmac_available

logger = logging.getLogger("fastmq")

MODES = ("mac", "encrypt", "none")
KEY_BYTES = 32
TAG_BYTES = 16          # GCM's tag
PROOF_BYTES = 32        # HMAC-SHA256
NONCE_BYTES = 16        # each side's handshake nonce

# nonce = (sequence number, index): segment k of a message is index k;
# its header is HEADER_INDEX (never a segment's: 2**32 segments would be a
# message of petabytes); a small message sealed whole uses HEADER_INDEX
# alone (a message is either whole or segmented).
_NONCE = struct.Struct("<QI")
HEADER_INDEX = 0xFFFFFFFF

_warned_none = False


def mode(asked: str | None) -> str:
    """The constructor's ``remote_security``, else ``FASTMQ_REMOTE_SECURITY``,
    else ``"mac"``; a clear ``ValueError`` for anything else."""
    where = "remote_security"
    if asked is None:
        where = "FASTMQ_REMOTE_SECURITY"
        asked = os.environ.get(where, "").strip()
        curve = os.environ.get("FASTMQ_CURVE", "").strip()
        if not asked and curve:
            # The earlier switch (ZMQ CURVE): on meant encrypted, off plain.
            where = "FASTMQ_CURVE"
            asked = "none" if curve.lower() in ("0", "false", "no", "off") else "encrypt"
        asked = asked or "mac"
    if asked not in MODES:
        raise ValueError(f"fastmq: {where}={asked!r} is not one of {', '.join(MODES)}")
    global _warned_none
    if asked == "none" and not _warned_none:
        _warned_none = True
        logger.warning("fastmq: remote readers use plain, unauthenticated TCP "
                       "(remote security 'none'): anyone who can reach the port can read "
                       "the messages or pose as a reader")
    return asked


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.digest(secret, b"fastmq remote path: " + purpose, "sha256")


class Seal:
    """One queue's keys, for one security mode.

    ``tag_bytes`` is what each sealed part adds on the wire (0 in
    ``"none"``)."""

    def __init__(self, security: str, secret: bytes | None):
        self.mode = security
        self.tag_bytes = 0 if security == "none" else TAG_BYTES
        self.encrypting = security == "encrypt"
        if security == "none":
            self._hs_key = self._aead = self._gmac = self._gmac_large = None
            return
        if secret is None or len(secret) != KEY_BYTES:
            raise ValueError(f"fastmq: remote security {security!r} needs a "
                             f"{KEY_BYTES}-byte key in the handle")
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:
            raise RuntimeError(
                f"fastmq: remote security {security!r} needs the 'cryptography' package "
                "(pip install cryptography)") from e

        self._hs_key = _derive(secret, b"handshake")
        message_key = _derive(secret, b"messages " + security.encode())
        self._aead = AESGCM(message_key)
        # Tags with the key's state kept (fastmq._gmac), the same tags as
        # self._aead's: small parts (headers, small messages) always; a
        # large segment's too where the CPU computes them ("cpu": faster
        # than cryptography's OpenSSL, and without the GIL), else through
        # cryptography (faster on long runs than an older system libcrypto).
        self._gmac = Gmac(message_key) if gmac_available() else None
        self._gmac_large = self._gmac if self._gmac is not None and \
            self._gmac.engine == "cpu" else None

    # -- the handshake ------------------------------------------------------------
    def prove(self, role: bytes, *fields: bytes) -> bytes:
        """Proof that the sender holds the secret, bound to ``role`` and the
        handshake's fields (zeros in ``"none"``, where nothing is proven)."""
        if self._hs_key is None:
            return bytes(PROOF_BYTES)
        return hmac.digest(self._hs_key, role + b"".join(fields), "sha256")

    def proven(self, proof: bytes, role: bytes, *fields: bytes) -> bool:
        if self._hs_key is None:
            return True
        return hmac.compare_digest(proof, self.prove(role, *fields))

    # -- messages -----------------------------------------------------------------
    def tag_header(self, seq: int, header) -> bytes:
        """A header's tag: authenticated, never encrypted (a reader needs
        the frame lengths before it can take the frames)."""
        if self._gmac is not None:
            return self._gmac.tag(seq, HEADER_INDEX, (header,))
        return self._aead.encrypt(_NONCE.pack(seq, HEADER_INDEX), b"", header)

    def check_header(self, seq: int, header, tag) -> bool:
        if self._gmac is not None:
            return self._gmac.check(seq, HEADER_INDEX, (header,), tag)
        return self._check(_NONCE.pack(seq, HEADER_INDEX), header, tag)

    def seal_whole(self, seq: int, header: bytes, views: list) -> list:
        """The wire form of a small message sealed at once (one tag for
        header and frames; ``"encrypt"``: the frames encrypted, the header
        authenticated)."""
        if self._aead is None:
            return [header, *views]
        if self.encrypting:
            nonce = _NONCE.pack(seq, HEADER_INDEX)
            return [header, self._aead.encrypt(nonce, b"".join(views), header)]
        if self._gmac is not None:
            wire = [header, *views]
            wire.append(self._gmac.tag(seq, HEADER_INDEX, wire))
            return wire
        blob = b"".join([header, *views])
        return [blob, self._aead.encrypt(_NONCE.pack(seq, HEADER_INDEX), b"", blob)]

    def open_whole(self, seq: int, wire: memoryview, header_len: int, body_len: int):
        """The frames' bytes of a message ``seal_whole`` made (``wire`` is
        all of it, tag included), or None if it does not check."""
        end = header_len + body_len
        if self._gmac is not None and not self.encrypting:
            if self._gmac.check(seq, HEADER_INDEX, (wire[:end],), wire[end:]):
                return wire[header_len:end]
            return None
        if self._aead is None:
            return wire[header_len:end]
        nonce = _NONCE.pack(seq, HEADER_INDEX)
        if self.encrypting:
            try:
                return self._aead.decrypt(nonce, wire[header_len:], wire[:header_len])
            except InvalidTag:
                return None
        return wire[header_len:end] if self._check(nonce, wire[:end], wire[end:]) else None

    def seal(self, seq: int, index: int, part) -> list:
        """The wire form of segment ``index`` of message ``seq``:
        ``[part, tag]`` (``"mac"``), ``[ciphertext with its tag]``
        (``"encrypt"``), ``[part]`` (``"none"``)."""
        if self._aead is None:
            return [part]
        if self.encrypting:
            return [self._aead.encrypt(_NONCE.pack(seq, index), part, None)]
        return [part, self.tag(seq, index, part)]

    def tag(self, seq: int, index: int, part) -> bytes:
        """The tag segment ``index`` of message ``seq`` must carry
        (``"mac"``): a reader computes it as soon as the segment is in,
        while the writer's tag is still on its way, and then ``matches``."""
        if self._gmac_large is not None:
            return self._gmac_large.tag(seq, index, (part,))
        return self._aead.encrypt(_NONCE.pack(seq, index), b"", part)

    @staticmethod
    def matches(expected: bytes, tag) -> bool:
        return hmac.compare_digest(expected, tag)

    def decrypt_into(self, seq: int, index: int, wire, out: memoryview) -> bool:
        """``"encrypt"``: check ``wire`` (ciphertext and tag) and leave the
        plaintext in ``out``; False (``out`` untouched) if it does not check."""
        try:
            out[:] = self._aead.decrypt(_NONCE.pack(seq, index), wire, None)
        except InvalidTag:
            return False
        return True

    def _check(self, nonce: bytes, part, tag) -> bool:
        try:
            self._aead.decrypt(nonce, tag, part)
        except InvalidTag:
            return False
        return True


try:
    from cryptography.exceptions import InvalidTag
except ImportError:  # only "none" works without it; Seal says so
    class InvalidTag(Exception):
        pass
