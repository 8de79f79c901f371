"""Worker groups over mx.distributed: the command channel, the replicated engine
state and weight sharding."""
