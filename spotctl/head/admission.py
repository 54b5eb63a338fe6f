"""A threaded HTTP server that admits each connection before a thread serves it and gives
its place back once, however the thread ends. The head's API and the local metadata
emulator bound their connections with it (each decides admission its own way)."""

from __future__ import annotations

from http.server import ThreadingHTTPServer
from typing import Any


class AdmittingHTTPServer(ThreadingHTTPServer):
    def _admit(self, request: Any, client_address: Any) -> bool:
        """Take a place for this connection; False closes it at once."""
        raise NotImplementedError

    def _release(self, request: Any) -> None:
        """Give the connection's place back (called once it ends; must be idempotent)."""
        raise NotImplementedError

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._admit(request, client_address):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)
