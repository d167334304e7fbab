"""A real server (uvicorn in a thread, free port) around the session's SmolLM2, for the serve tests."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")


@contextmanager
def running(app, limits=None):
    """Serve app on 127.0.0.1:<free port> until the block ends, under `attnlab serve`'s uvicorn config
    (`attnlab.serve.conn`, with these Limits); yields the base URL."""
    from attnlab.serve.conn import GuardedServer, Limits, serve_config
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = GuardedServer(serve_config(app, limits=limits or Limits(), lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def served(smollm2):
    """(base_url, app) of a sink-256 server that takes prompts of at most 4096 tokens."""
    from attnlab.serve import PolicySpec, ServeConfig, create_app
    app = create_app(smollm2, ServeConfig("smollm2-135m", PolicySpec("sink", 256, 4, "cache"), max_prompt_tokens=4096,
                                          chunk=64, max_tokens=16))
    with running(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI
    return OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
