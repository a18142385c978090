"""The embedded engine: `weightsync serve`, a CPU inference server that speaks
SGLang's HTTP weight-update API and weightsync's own `/weightsync/*` routes.

Layout:
- HTTP boundary: `app` (generation, health, info), `routes_updates`,
  `routes_lora`, `http` (bodies, admin key, errors -> JSON), `serving`
  (socket + uvicorn), `config`, `state` (what the routes share);
- generation: `scheduler` (the step loop, pause modes), `runner` (the model,
  KV caches, batching), `requests` (one request's state and answer),
  `sampling`;
- weights: `updates` (staging, versions, atomic commits), `buffers` (receive
  buffers reused across updates), `lora` (adapters, per-request routing),
  `ingest` and `unpickle` (request payloads -> checked tensors);
- `launch`: start a server subprocess and wait for it (tests, demo, bench);
  `forkserver`: the same servers forked from a process that imported them once (a
  test suite's many starts).

Importing this package is light; FastAPI, uvicorn and transformers load only
when a server is built.
"""

from weightsync.server.launch import ServerProcess, ServerStartError, launch_server

__all__ = ["ServerProcess", "ServerStartError", "launch_server"]
