"""Addresses for the queue's ZMQ sockets."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import tempfile

IPC_PREFIX = "fastmq_"


def new_ipc_path() -> tuple[str, str]:
    """(zmq address, file path) of a fresh ipc endpoint owned by this process."""
    path = os.path.join(tempfile.gettempdir(),
                        f"{IPC_PREFIX}{os.getpid()}_{secrets.token_hex(6)}.ipc")
    return f"ipc://{path}", path


def bind_ipc(sock) -> tuple[str, str]:
    """Bind ``sock`` to a fresh owner-only ipc endpoint; return (zmq address,
    file path).

    libzmq creates the socket file with the process umask (typically 0755;
    connecting needs write permission, so a group-writable umask would let
    other users subscribe).  A chmod after a bind at the public path leaves
    a window in which another user could connect and stay connected (the
    permission is only checked at connect time).  So the file is bound inside
    a fresh 0700 directory, made 0600 there, and only then renamed to its
    public name: it is never reachable with looser permissions.  Renaming
    keeps the inode, so the bound socket answers at the new path.
    """
    addr, path = new_ipc_path()
    private = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}_", suffix=".bind",
                               dir=os.path.dirname(path))
    staged = os.path.join(private, "s")
    try:
        sock.bind(f"ipc://{staged}")
        os.chmod(staged, 0o600)
        os.rename(staged, path)
    finally:
        for remove, p in ((os.unlink, staged), (os.rmdir, private)):
            try:
                remove(p)  # the staged name is gone once renamed
            except OSError:
                pass
    return addr, path


def new_inproc_path() -> str:
    return f"inproc://fastmq_{secrets.token_hex(8)}"


def is_ipv6(addr: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(addr.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def local_ip() -> str:
    """This host's address as other nodes see it: FASTMQ_HOST_IP or
    VLLM_HOST_IP when set, else what the host name resolves to."""
    for var in ("FASTMQ_HOST_IP", "VLLM_HOST_IP"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
