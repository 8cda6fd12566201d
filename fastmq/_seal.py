"""Authentication (and, as an option, encryption) of the remote path's
messages, under the queue's message key (``fastmq._keys`` says where it
comes from and how each reader gets it).

The threat model: docs/operations.md, "Security".

Every message is sealed, its header and each segment of its frames, with
AES-256-GCM under a nonce made of the message's *seal counter* and the
part's index.  The counter is the writer's own: advanced for every message
it seals, before the first tag, and never rolled back, so that a message
abandoned half-way (an exception, a timeout) leaves its counter value
behind and the next message gets a new one: no nonce is ever used twice
under one key (the key is fresh per queue).  The delivery sequence number
is separate and authenticated in the header; a reader takes counters only
increasing and sequence numbers only in order, so nothing can be injected,
changed, reordered, replayed or dropped unnoticed.

Security modes (``remote_security=`` or ``FASTMQ_REMOTE_SECURITY``):

* ``"mac"`` (default): authenticated, not encrypted.  The tag is GMAC, the
  payload being GCM's associated data: one more pass over the bytes on
  each side.  Small parts are tagged through the process's libcrypto with
  the key's state kept (``fastmq._gmac``, a few tenths of a microsecond),
  large segments through ``cryptography``'s AES-GCM (without the GIL); both
  are OpenSSL, and the tags are the same whichever computes them.
* ``"encrypt"``: AES-256-GCM, confidentiality too (``cryptography``).
* ``"none"``: plain TCP, as vLLM's remote readers; anyone who reaches the
  port can read the stream, and be taken for a reader.
"""
from __future__ import annotations

import hmac
import logging
import os
import struct

from fastmq._gmac import Gmac, available as gmac_available

logger = logging.getLogger("fastmq")

MODES = ("mac", "encrypt", "none")
TAG_BYTES = 16          # GCM's tag

# nonce = (seal counter, index): segment k of a message is index k; its
# header is HEADER_INDEX (never a segment's: 2**32 segments would be a
# message of petabytes); a small message sealed whole, and the end of the
# stream, use HEADER_INDEX alone.
_NONCE = struct.Struct("<QI")
HEADER_INDEX = 0xFFFFFFFF
# Parts this large are tagged through cryptography, which lets go of the GIL.
LARGE_BYTES = 256 * 1024

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


class Seal:
    """One queue's message key, for one security mode (``key`` is None in
    ``"none"``).  ``tag_bytes`` is what each sealed part adds on the wire."""

    def __init__(self, security: str, key: bytes | None):
        self.mode = security
        self.tag_bytes = 0 if security == "none" else TAG_BYTES
        self.encrypting = security == "encrypt"
        self.key = key
        if security == "none":
            self._aead = self._gmac = self._decrypt_into = self._encrypt_into = None
            return
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as e:
            raise RuntimeError(
                f"fastmq: remote security {security!r} needs the 'cryptography' package "
                "(pip install cryptography)") from e
        self._aead = AESGCM(key)
        # In place where this cryptography has them: a fresh ``bytes`` per
        # segment costs its pages on top of the cipher (fastmq._wire).
        self._decrypt_into = getattr(self._aead, "decrypt_into", None)
        self._encrypt_into = getattr(self._aead, "encrypt_into", None)
        # Small parts' tags with the key's state kept (fastmq._gmac); where
        # no libcrypto loads, every tag comes through cryptography.
        self._gmac = Gmac(key) if gmac_available() else None

    def for_reader(self, reader_nonce: bytes) -> "Seal":
        """The seal of one reader's heartbeats to its writer: under a key of
        their own, derived from the message key and the reader's handshake
        nonce (unique per connection), so that the reader's counter never
        meets a nonce the writer, or another reader, uses."""
        if self.key is None:
            return Seal("none", None)
        from fastmq._keys import hkdf
        return Seal("mac", hkdf(self.key, None, b"fastmq reader heartbeat" + reader_nonce))

    def tag_header(self, counter: int, header) -> bytes:
        """A header's tag: authenticated, never encrypted (a reader needs
        the frame lengths before it can take the frames)."""
        if self._gmac is not None:
            return self._gmac.tag(counter, HEADER_INDEX, (header,))
        return self._aead.encrypt(_NONCE.pack(counter, HEADER_INDEX), b"", header)

    def check_header(self, counter: int, header, tag) -> bool:
        if self._gmac is not None:
            return self._gmac.check(counter, HEADER_INDEX, (header,), tag)
        return self._check(_NONCE.pack(counter, HEADER_INDEX), header, tag)

    def seal_whole(self, counter: int, header: bytes, views: list) -> list:
        """The wire form of a small message sealed at once (one tag for
        header and frames; ``"encrypt"``: the frames encrypted, the header
        authenticated)."""
        if self._aead is None:
            return [header, *views]
        if self.encrypting:
            nonce = _NONCE.pack(counter, HEADER_INDEX)
            return [header, self._aead.encrypt(nonce, b"".join(views), header)]
        if self._gmac is not None:
            wire = [header, *views]
            wire.append(self._gmac.tag(counter, HEADER_INDEX, wire))
            return wire
        blob = b"".join([header, *views])
        return [blob, self._aead.encrypt(_NONCE.pack(counter, HEADER_INDEX), b"", blob)]

    def open_whole(self, counter: int, wire: memoryview, header_len: int, body_len: int):
        """The frames' bytes of a message ``seal_whole`` made (``wire`` is
        all of it, tag included), or None if it does not check."""
        end = header_len + body_len
        if self._aead is None:
            return wire[header_len:end]
        nonce = _NONCE.pack(counter, HEADER_INDEX)
        if self.encrypting:
            try:
                return self._aead.decrypt(nonce, wire[header_len:], wire[:header_len])
            except InvalidTag:
                return None
        if self._gmac is not None:
            ok = self._gmac.check(counter, HEADER_INDEX, (wire[:end],), wire[end:])
        else:
            ok = self._check(nonce, wire[:end], wire[end:])
        return wire[header_len:end] if ok else None

    @property
    def encrypts_into(self) -> bool:
        """Whether ``seal`` can leave a segment's ciphertext in memory the
        caller gives (``"encrypt"`` with ``AESGCM.encrypt_into``)."""
        return self._encrypt_into is not None

    def seal(self, counter: int, index: int, part, out=None) -> list:
        """The wire form of segment ``index`` of the message sealed under
        ``counter``: ``[part, tag]`` (``"mac"``), ``[ciphertext with its
        tag]`` (``"encrypt"``), ``[part]`` (``"none"``).  ``out``
        (``"encrypt"``, where ``encrypts_into``): writable memory of
        exactly ``len(part) + tag_bytes`` bytes that receives the
        ciphertext and is returned as it."""
        if self._aead is None:
            return [part]
        if self.encrypting:
            nonce = _NONCE.pack(counter, index)
            if out is not None and self._encrypt_into is not None:
                self._encrypt_into(nonce, part, None, out)
                return [out]
            return [self._aead.encrypt(nonce, part, None)]
        return [part, self.tag(counter, index, part)]

    def tag(self, counter: int, index: int, part) -> bytes:
        """The tag segment ``index`` must carry (``"mac"``): a reader
        computes it as soon as the segment is in, while the writer's tag is
        still on its way, and then ``matches``."""
        if self._gmac is not None and len(part) < LARGE_BYTES:
            return self._gmac.tag(counter, index, (part,))
        return self._aead.encrypt(_NONCE.pack(counter, index), b"", part)

    @staticmethod
    def matches(expected: bytes, tag) -> bool:
        return hmac.compare_digest(expected, tag)

    def decrypt_into(self, counter: int, index: int, wire, out: memoryview) -> bool:
        """``"encrypt"``: check ``wire`` (ciphertext and tag) and leave the
        plaintext in ``out``; False if it does not check (then ``out`` holds
        nothing to use: the caller drops it).  Straight into ``out`` where
        this ``cryptography`` has ``AESGCM.decrypt_into``: the plaintext in
        a fresh ``bytes`` first, then copied, costs several times the
        decryption."""
        nonce = _NONCE.pack(counter, index)
        try:
            if self._decrypt_into is not None:
                self._decrypt_into(nonce, wire, None, out)
            else:
                out[:] = self._aead.decrypt(nonce, wire, None)
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
