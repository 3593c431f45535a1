"""uvicorn with kvserve's start and stop: the usage hint once it listens, and on SIGTERM /
SIGINT a graceful stop whose ``on_deadline`` runs shortly before ``--shutdown-timeout``
ends, so that requests still running end cleanly (error event and ``[DONE]``, or a 503)
rather than being cut when uvicorn cancels them."""
from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Callable

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, app, args: argparse.Namespace, hint: str,
                 on_deadline: Callable[[], None]) -> None:
        super().__init__(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                        access_log=not args.disable_access_log,
                                        timeout_graceful_shutdown=args.shutdown_timeout))
        timeout = args.shutdown_timeout
        self.drain_after = timeout - min(0.5, timeout * 0.2)
        self.hint = hint
        self.on_deadline = on_deadline

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.hint, flush=True)

    def handle_exit(self, sig, frame) -> None:  # SIGTERM / SIGINT, on the loop's thread
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.started:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon_threadsafe(loop.call_later, self.drain_after, self.on_deadline)

    def run(self, sockets=None) -> None:
        # uvicorn handles SIGTERM/SIGINT gracefully, then restores the previous handlers
        # and re-raises the signal; a no-op handler there makes the graceful exit status 0.
        previous = {sig: signal.signal(sig, lambda *_: None)
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            super().run(sockets)
        finally:  # what runs after (shutting Ray down) can be interrupted again
            for sig, handler in previous.items():
                signal.signal(sig, handler)
