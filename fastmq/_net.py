"""Addresses for the queue's ZMQ sockets."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket

import zmq

IPC_PREFIX = "fastmq_"


def bind_ipc(sock) -> str:
    """Bind ``sock`` to a fresh ipc endpoint; return its zmq address.

    The endpoint is in Linux's abstract socket namespace (``ipc://@...``):
    it has no file, so a process that dies, however it dies, leaves none
    behind; the name goes with the socket.  An abstract socket has no file
    permissions: any process of this network namespace can connect, of any
    user (a root reader of a non-root writer, as with vLLM's socket file).
    What keeps strangers out is the handle: the data socket applies only
    the subscriptions of readers that prove they hold it
    (``fastmq._subscribers``), and the notify socket carries nothing but
    one-byte wakeups.
    """
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
