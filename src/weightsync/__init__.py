"""weightsync: verified weight synchronization from RL trainers to inference engines."""
