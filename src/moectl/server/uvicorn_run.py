"""Run the app under uvicorn until SIGTERM or SIGINT, then leave with exit status 0.

uvicorn handles both signals gracefully: it stops accepting connections, lets in-flight
responses finish, then runs the app's shutdown (the engine drains and its thread joins). After
that it re-raises the signal it stopped on, under the handler that was installed before it ran;
with the default handler that would end the process by the signal (status -15) although the
shutdown was clean. :func:`serve` installs a handler that ignores the re-raised signal, so a
clean shutdown exits 0.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from moectl.errors import UnavailableError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def serve(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Serve ``app`` on ``host:port`` until a signal stops it gracefully."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
    server = uvicorn.Server(config)
    if threading.current_thread() is not threading.main_thread():  # signals belong to the main thread
        server.run()
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        raise UnavailableError(f"the server on {host}:{port} did not start (the log above says why)")
