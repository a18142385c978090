"""The receiving side of an update, shared by every engine: who holds the engine's session
(`sessions`), the update session that checks and stages what arrives (`update_session`), and the
receive path, the one way bytes reach it (`receive_path`). It imports the core records,
formats and transports' receivers only: never an engine, the server, a mode or `push`.
"""
