"""The trainer side of a push: the coordinator (`sync.WeightSync`), its plan, the rounds it
makes of the engine replicas, the streaming pipeline, the other trainer ranks' part, and
how a push fans out to the engines (`fanout/`: direct, relay, shares). It drives engines,
transports, modes and sources through what they declare; it never imports the server, the
receiving side (`weightsync.receive`), the CLI or an integration.
"""
