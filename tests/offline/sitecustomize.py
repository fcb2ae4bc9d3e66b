"""On PYTHONPATH, makes this process and every process it starts (DataLoader and litdata workers inherit the
environment) behave as on an air-gapped machine: a host name does not resolve and a connection is refused. Each
attempt is appended to the file named by MEMFIT_TEST_NETWORK_LOG, so a test can say who tried to reach what."""

import os
import socket

_log = os.environ.get("MEMFIT_TEST_NETWORK_LOG")
_getaddrinfo, _connect = socket.getaddrinfo, socket.socket.connect


def _record(what: str) -> None:
    if _log:
        with open(_log, "a") as f:
            f.write(f"{what}\n")


def getaddrinfo(host, port, *args, **kwargs):
    if host in (None, "localhost", "127.0.0.1", "::1"):  # local sockets (DDP's rendezvous, TensorBoard) still work
        return _getaddrinfo(host, port, *args, **kwargs)
    _record(f"resolve {host}:{port}")
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (offline)")


def connect(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if self.family == socket.AF_UNIX or host in ("localhost", "127.0.0.1", "::1"):
        return _connect(self, address)
    _record(f"connect {address}")
    raise ConnectionRefusedError(111, "Connection refused (offline)")


socket.getaddrinfo = getaddrinfo
socket.socket.connect = connect


def _next_sitecustomize() -> None:
    """Only the first sitecustomize on the path runs: run the next one too (a test's own, e.g.
    tests/without_packages), so an offline process can also lack packages or emulate another CPU."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    later = [entry for entry in sys.path if entry and os.path.abspath(entry) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.origin and os.path.dirname(os.path.abspath(spec.origin)) != here:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_next_sitecustomize()
