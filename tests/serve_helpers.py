"""What the Serve tests share: the test corpus, the API key and a free port (the fixture is in conftest.py)."""

from __future__ import annotations

import socket

KEY = "test-key"
DOCS = [
    ("Bridges", "The Forth Bridge is a cantilever railway bridge across the Firth of Forth in Scotland. It was "
                "designed by John Fowler and Benjamin Baker and opened in 1890. It is 2,467 metres long."),
    ("Tea", "Green tea is made from leaves that are not withered and oxidised like black tea. It is brewed at "
            "about 80 degrees Celsius for two to three minutes."),
    ("Glaciers", "A glacier is a persistent body of dense ice that moves under its own weight. Glaciers form "
                 "where snow accumulates faster than it melts over many years."),
]
QUESTION = "Who designed the Forth Bridge and when did it open?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
