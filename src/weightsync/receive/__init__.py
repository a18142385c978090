"""The receiving side of an update, written once for every engine: who holds the engine's
session (`sessions`), the update session that checks and stages what arrives (`receiving`),
and the receive path that fetches by link, stages and acks (`receive_path`). It imports the
core records and transports' receivers only: never an engine, the server, a mode or `push`.
"""
