"""The sockets a process and its descendants listen on, read from /proc (Linux).

TCP sockets in the LISTEN state and bound, unconnected UDP sockets (they take datagrams from
anyone), from /proc/PID/net/{tcp,tcp6,udp,udp6}, matched to the processes through the socket
inodes of /proc/PID/fd. Used to check that what pagedllm starts is reachable from loopback only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

# /proc/net state column: TCP_LISTEN; for UDP, TCP_CLOSE (7) is a bound, unconnected socket.
_LISTENING = {"tcp": "0A", "tcp6": "0A", "udp": "07", "udp6": "07"}


@dataclass(frozen=True)
class Listener:
    proto: str
    address: str
    port: int
    pid: int
    command: str

    @property
    def is_loopback(self) -> bool:
        ip = ipaddress.ip_address(self.address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_loopback


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (children of any of its threads), alive now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(k) for k in f.read().split()]
        except OSError:  # exited meanwhile
            pass
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _address(hex_address: str, v6: bool) -> tuple[str, int]:
    """/proc/net's ADDR:PORT: the address in host byte order, 32-bit word by word."""
    ip, port = hex_address.split(":")
    raw = bytes.fromhex(ip)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(port, 16)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def listeners(pid: int) -> list[Listener]:
    """Every listening socket of ``pid``'s process tree (all of it in ``pid``'s network namespace)."""
    owner = {inode: p for p in process_tree(pid) for inode in _socket_inodes(p)}
    found = []
    for proto, state in _LISTENING.items():
        with open(f"/proc/{pid}/net/{proto}") as f:
            next(f)  # the header
            for line in f:
                cols = line.split()
                inode = int(cols[9])
                if cols[3] == state and inode in owner:
                    address, port = _address(cols[1], proto.endswith("6"))
                    found.append(Listener(proto, address, port, owner[inode], _command(owner[inode])))
    return found


def assert_loopback_only(pid: int, expect_processes: int) -> list[Listener]:
    """Every socket ``pid``'s tree listens on is bound to a loopback address; the listeners.
    ``expect_processes``: at least this many of the tree's processes listen (so that a tree whose
    sockets were not found cannot pass)."""
    found = listeners(pid)
    exposed = [x for x in found if not x.is_loopback]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))
    assert len({x.pid for x in found}) >= expect_processes, found
    return found
