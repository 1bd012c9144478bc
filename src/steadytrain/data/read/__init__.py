"""The read wing: a token-shard dataset in, micro-batches out (see ``data/__init__``)."""
