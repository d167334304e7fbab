"""An OpenAI-compatible HTTP server whose conversations each live in a bounded KV cache.

`create_app(lm, ServeConfig(name))` builds the FastAPI app (optional extra: `pip install attnlab[serve]`);
`attnlab serve` runs it under uvicorn. See `app.py` (`Server`) for the endpoints, `scheduler.py`
for continuous batching (the model thread of `worker.py` steps it), `sessions.py` for how a resent
history finds its cache again, `guard.py` for Host/key/body checks, and docs/serve.md for limits
and the security model.
"""
from attnlab.options import PolicySpec
from attnlab.serve.app import Server, create_app
from attnlab.serve.config import Keys, Limits, ServeConfig
from attnlab.serve.sessions import SessionStore

__all__ = ["create_app", "Server", "ServeConfig", "Keys", "Limits", "PolicySpec", "SessionStore"]
