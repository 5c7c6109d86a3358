"""A wire with a delay: Ethernet frames between two interfaces, each held back.

    ip netns exec NS python -m loadtests.netwire IFACE_A IFACE_B DELAY_MS

This kernel has no ``netem`` (nor ``fq``) queueing discipline, so a link's
delay is made here, in user space: every frame that arrives on one interface
leaves on the other ``DELAY_MS`` later, in order, both ways (a constant delay,
so a FIFO per direction is the schedule). The sockets are ``AF_PACKET`` with
``PACKET_VNET_HDR``: a TCP super-frame (GSO) and its offloaded checksum travel
with their virtio header and the kernel finishes them on the way out, as a
hypervisor's virtual NIC does. Frames the wire itself sends are not read back.
Stdlib only; it runs until SIGTERM.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
PR_SET_TIMERSLACK = 29
FRAME_BYTES = 65536 + 64
"""A GSO frame and its virtio header fit."""

Queue = collections.deque[tuple[float, bytes]]


def open_port(interface: str) -> socket.socket:
    """A raw socket on ``interface`` that reads and writes frames with virtio headers."""
    port = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    port.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    port.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    port.bind((interface, 0))
    port.setblocking(False)
    return port


def take(port: socket.socket, queue: Queue, delay_s: float) -> None:
    """Queue every frame waiting on ``port``, due ``delay_s`` from now."""
    while True:
        try:
            frame, address = port.recvfrom(FRAME_BYTES)
        except BlockingIOError:
            return
        if address[2] != PACKET_OUTGOING:
            queue.append((time.monotonic() + delay_s, frame))


def send_due(port: socket.socket, queue: Queue, now: float) -> None:
    """Send the frames of ``queue`` that are due; a full or downed link drops them."""
    while queue and queue[0][0] <= now:
        frame = queue.popleft()[1]
        with contextlib.suppress(OSError):  # a downed link loses its frames, as a cable would
            port.send(frame)


def run(first: str, second: str, delay_s: float) -> None:
    """Carry frames both ways until SIGTERM (its default action: frames in flight
    are lost, as on a cable that is pulled)."""
    ports = [open_port(first), open_port(second)]
    queues: list[Queue] = [collections.deque(), collections.deque()]  # towards each port
    while True:
        due = [q[0][0] for q in queues if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 0.5
        readable, _, _ = select.select(ports, [], [], timeout)
        for port in readable:
            # A frame read on one port leaves by the other.
            take(port, queues[1 - ports.index(port)], delay_s)
        now = time.monotonic()
        for port, queue in zip(ports, queues, strict=True):
            send_due(port, queue, now)


def main(argv: list[str]) -> None:
    """``IFACE_A IFACE_B DELAY_MS``."""
    first, second, delay_ms = argv
    # Sleep wakes up within a few microseconds, not the default 50 us slack.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    run(first, second, float(delay_ms) / 1000)


if __name__ == "__main__":
    main(sys.argv[1:])
