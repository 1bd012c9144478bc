"""Token data, in two wings.

* ``steadytrain.data.ingest``: raw text (or a Megatron dataset) in, a verified token-shard
  dataset out: tokenize, tokenizer, sources, megatron, writer, output, verify, shuffle.
* ``steadytrain.data.read``: a dataset in, micro-batches out, in a pure, resumable order:
  format, dataset, sampler, blend, modes, permute, loader, producers, workers, schedule.

Ingest may import read (it writes and checks the format read defines); read never imports
ingest. Both reach bytes through ``steadytrain.storage``.
"""
