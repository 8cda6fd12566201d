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
