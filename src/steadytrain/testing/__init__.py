"""Harnesses for tests, demos and benchmarks; nothing in the runtime path imports this.

* ``s3_server``: a real S3 server (SeaweedFS ``weed mini``) on loopback;
* ``slowlink``: a TCP proxy that adds latency and caps bandwidth on loopback;
* ``tmpfs``: a size-limited tmpfs mount (a small disk that fills up);
* ``nodes`` (with ``netns``): K nodes on one machine, a network namespace, a local disk and a
  torchrun agent each, one SeaweedFS behind a slow-link proxy per node (docs/testing.md);
* ``synthetic``: ledger records on an explicit clock, fed through a real meter (alert,
  goodput and report tests that must not depend on the machine's speed).
"""
