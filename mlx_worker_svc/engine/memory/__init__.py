"""Memory: device facts, profiling, the memory guard and the KV budget."""
