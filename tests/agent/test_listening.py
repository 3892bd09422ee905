"""The agent's listening-ports reader (agent/listening.py): what a restore of a checkpoint waits for."""

from __future__ import annotations

import socket

from keepstate.agent import listening

TCP = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:C34F 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 2200580A:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 3 1
   3: 2200580A:C34F 2100580A:BAD6 01 00000000:00000000 00:00000000 00000000     0        0 4 1
   4: 0100007F:1F41 0100007F:48E4 08 00000000:00000000 00:00000000 00000000     0        0 5 1
"""
TCP6 = """  sl  local_address                         remote_address                        st
   0: 00000000000000000000000000000000:1F42 00000000000000000000000000000000:0000 0A
   1: 00000000000000000000000001000000:1F43 00000000000000000000000000000000:0000 0A
   2: 0000000000000000FFFF00000100007F:1F44 00000000000000000000000000000000:0000 0A
"""


def test_ports_on_reachable_addresses_only() -> None:
    # 49999 on any address, 8000 on eth0's, 8002 on [::]; not 8080 on 127.0.0.1, 8003 on [::1] nor 8004 on a
    # v4-mapped loopback; connections (01, 08) are no listeners.
    assert listening.listening_ports([TCP, TCP6]) == [8000, 8002, 49999]


def test_read_finds_a_real_listener() -> None:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port in listening.read()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert s.getsockname()[1] not in listening.read()
