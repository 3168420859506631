"""Where the tensor-parallel ranks of one engine meet, and which network interface they talk over.

What the ranks exchange is trusted blindly: the step broadcast is a pickle (torch.distributed's
broadcast_object_list), and neither the store nor gloo authenticates a peer. So nothing they use
may listen where another machine can reach it, unless the operator names an interface for that:

- **One node** (the "mp" executor; the "ray" executor when every rank landed on the driver's
  node): the store is a ``FileStore`` in a private temporary directory (mode 0700, removed at
  shutdown), not a TCP store: torch's TCPStore server listens on every interface even when given
  127.0.0.1. Gloo's connections use the loopback interface.
- **Several nodes** (the "ray" executor, ranks on other nodes): only with ``distributed_interface``
  (``--distributed-interface``) set. The store is a TCPStore whose listening socket this module
  binds to that interface's address (torch would bind every interface), and gloo uses that
  interface on every node. docs/scaling.md says what this exposes and how to secure it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# Linux's loopback interface (the executors run on Linux: they pin ranks with sched_setaffinity).
LOOPBACK_INTERFACE = "lo"
# The environment variable torch's gloo backend reads for the interface of its connections.
_GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@dataclass(frozen=True)
class Rendezvous:
    """What every rank is told: the store to join, and the interface gloo binds to.

    ``file``: a FileStore's path (one node); else ``host``:``port``: the driver's TCP store.
    """

    interface: str
    file: str | None = None
    host: str | None = None
    port: int | None = None

    def join(self, world_size: int, timeout: timedelta) -> dist.Store:
        """A worker rank's handle on the store (rank 0 serves it: DriverRendezvous.serve)."""
        if self.file is not None:
            store = dist.FileStore(self.file, world_size)
            store.set_timeout(timeout)
            return store
        assert self.host is not None and self.port is not None
        return dist.TCPStore(self.host, self.port, world_size, is_master=False, timeout=timeout)


class DriverRendezvous:
    """Rank 0's side of a Rendezvous: it owns the private directory (one node) or the listening
    socket (several nodes) until ``close``. Build it with ``on_this_node`` or ``on_interface``."""

    def __init__(self, spec: Rendezvous, temp_dir: str | None = None, listener: socket.socket | None = None) -> None:
        self.spec = spec
        self._temp_dir = temp_dir
        self._listener = listener

    @classmethod
    def on_this_node(cls) -> DriverRendezvous:
        """A FileStore in a fresh directory only this user can enter (mkdtemp makes it 0700)."""
        temp_dir = tempfile.mkdtemp(prefix="pagedllm-tp-")
        return cls(Rendezvous(LOOPBACK_INTERFACE, file=os.path.join(temp_dir, "store")), temp_dir=temp_dir)

    @classmethod
    def on_interface(cls, interface: str) -> DriverRendezvous:
        """A TCP store listening on ``interface``'s IPv4 address only (a port the kernel picks)."""
        host = interface_address(interface)
        listener = socket.create_server((host, 0))
        return cls(Rendezvous(interface, host=host, port=listener.getsockname()[1]), listener=listener)

    def serve(self, world_size: int, timeout: timedelta) -> dist.Store:
        """Rank 0's store: the FileStore, or the TCP store server on the socket bound above."""
        if self.spec.file is not None:
            return self.spec.join(world_size, timeout)
        assert self._listener is not None, "the TCP store was served already"
        fd = self._listener.detach()  # the store owns the socket from here on
        self._listener = None
        return dist.TCPStore(
            self.spec.host,
            self.spec.port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )

    def close(self) -> None:
        """Removes the private directory / closes a socket no store took (idempotent)."""
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


@contextlib.contextmanager
def gloo_interface(interface: str) -> Iterator[None]:
    """Gloo binds the process groups made inside this block to ``interface`` (it reads
    GLOO_SOCKET_IFNAME when a group is made; left unset it binds the address this host's name
    resolves to, which may face the network). The variable is restored after: in the driver it
    is the server's own environment."""
    before = os.environ.get(_GLOO_IFNAME)
    os.environ[_GLOO_IFNAME] = interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_GLOO_IFNAME, None)
        else:
            os.environ[_GLOO_IFNAME] = before


def interface_address(interface: str) -> str:
    """The IPv4 address of the network interface ``interface`` (Linux's SIOCGIFADDR ioctl)."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        except OSError as e:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(
                f"distributed_interface={interface!r}: no IPv4 address on such an interface ({e.strerror}); "
                f"this node's interfaces: {names}."
            ) from None
    return socket.inet_ntoa(packed[20:24])
