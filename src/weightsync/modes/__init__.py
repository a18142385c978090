"""What each push mode does beyond streaming buckets, one module per mode.

The coordinator (`weightsync.sync`) asks these modules; it holds no per-mode
state of its own. Today: `lora` (versioned adapter names and their retiring).
The rest of the per-mode logic still lives in `sync.py` and moves here with
the redesign of issue #18.
"""
