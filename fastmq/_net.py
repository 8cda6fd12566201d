"""Addresses for the queue's ZMQ sockets."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket

import zmq

IPC_PREFIX = "fastmq_"


def bind_ipc(sock) -> str:
    """Bind ``sock`` to a fresh ipc endpoint that only this user's
    processes can connect to; return its zmq address.

    The endpoint is in Linux's abstract socket namespace (``ipc://@...``):
    it has no file, so a process that dies, however it dies, leaves none
    behind; the name goes with the socket.  An abstract socket has no file
    permissions, so libzmq checks each connecting peer's credentials
    (``SO_PEERCRED``) against this process's user and drops any other
    before it can subscribe (``IPC_FILTER_UID``, set before the bind: no
    window in which a stranger's connection is accepted).
    """
    uid_filter = getattr(zmq, "IPC_FILTER_UID", None)
    if uid_filter is None:
        raise RuntimeError(
            f"this pyzmq/libzmq ({zmq.pyzmq_version()}/{zmq.zmq_version()}) cannot filter ipc "
            "peers by user (ZMQ_IPC_FILTER_UID), which fastmq's local sockets need; "
            "install pyzmq's wheel, which bundles a libzmq that can")
    sock.setsockopt(uid_filter, os.getuid())
    addr = f"ipc://@{IPC_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
    sock.bind(addr)
    return addr


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
