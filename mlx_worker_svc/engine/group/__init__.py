"""Worker groups over `mx.distributed`: the command channel and watchdog every rank
shares, and the engine state every rank holds alike (`replica`).

Imports the runner, `engine.model` (a follower loads its shard), `engine.memory`
and core; the worker and rank 0's server above it drive the channel.
"""
