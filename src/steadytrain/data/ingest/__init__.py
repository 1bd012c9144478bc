"""The ingest wing: raw text in, a verified token-shard dataset out (see ``data/__init__``)."""
