"""The OpenAI-compatible server: ``create_app`` (an ASGI app to run or mount) and ``serve`` (uvicorn).

Needs the ``server`` extra (``pip install 'dasllama[server]'``: Starlette and uvicorn). The library
itself never imports this package.
"""
from __future__ import annotations

from typing import Any

from .protocol import APIError, Limits

__all__ = ["create_app", "serve", "APIError", "Limits"]


def create_app(*args: Any, **kwargs: Any):
    from .app import create_app as _create

    return _create(*args, **kwargs)


create_app.__doc__ = "See :func:`dasllama.server.app.create_app`."


def serve(model: Any = "smollm2-135m-instruct", host: str = "127.0.0.1", port: int = 8080, **kwargs: Any) -> None:
    """Run the server with uvicorn until interrupted (loopback by default)."""
    import uvicorn

    app = create_app(model, **kwargs)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        app.state.engine.stop()
