"""The embedded engine: `weightsync serve`, a CPU inference server that speaks
SGLang's HTTP weight-update API and weightsync's own `/weightsync/*` routes.

Its modules by concern (the HTTP boundary, generation, weights, starting a server):
docs/ARCHITECTURE.md, `server/`. Importing this package is light; FastAPI, uvicorn
and transformers load only when a server is built.
"""

from weightsync.server.launch import ServerProcess, ServerStartError, launch_server

__all__ = ["ServerProcess", "ServerStartError", "launch_server"]
