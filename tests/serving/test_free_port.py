"""free_port: the ports a stack asks for before binding any are distinct, bindable, and outside
the range the kernel gives outgoing connections."""

import socket

from dspark.serving.local_stack import LOWEST_PORT, ephemeral_port_range, free_port


def test_ports_asked_for_together_are_distinct_and_bindable():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_lie_below_the_ephemeral_range():
    low, high = ephemeral_port_range()
    assert LOWEST_PORT < low <= high
    if low - LOWEST_PORT >= 1000:
        assert all(LOWEST_PORT <= free_port() < low for _ in range(50))
