"""Data for the examples and benchmarks: token shards, synthetic graphs (imported from their modules)."""
