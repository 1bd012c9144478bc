"""A warm process per node: torch and the training script's modules imported before a
restart needs them (issue 44, section 3: "a spare node joins warm").

torchrun starts a node's workers only after a rendezvous round, so whatever a worker
imports is paid inside every whole restart, on every node, the spare that replaces a lost
node included (``bench/restart_phases.py``: imports are the largest phase here). So the
import moves out of the worker, without a new launcher:

- ``python -m steadytrain.warm --socket PATH SCRIPT`` (``server.py``), started on each
  node ahead of time -- with the node's agent, or on a spare when it is provisioned, beside
  ``steadytrain stage`` -- imports torch, steadytrain and the script's top-level imports,
  takes one optimizer step (``inplace.keeper``'s preload and warm-up), and waits on a Unix
  socket;
- torchrun's entry point is ``-m steadytrain.warm.enter SCRIPT ARGS`` (``enter.py``): a
  process that imports only the standard library, hands its arguments, environment,
  working directory and standard streams to the node's warm process, which forks the
  worker from its already-imported interpreter; it forwards torchrun's signals to the
  worker and ends the way the worker ended, so torchrun's agent watches, stops and restarts
  it as it would the worker itself. The warm process stays warm for the next restart.

When no warm process answers (not started, gone, refused) the entry runs the script itself,
cold, after a warning: the job runs either way. ``protocol.py`` holds the wire format.
"""

from steadytrain.warm.protocol import ENV_SOCKET

__all__ = ["ENV_SOCKET"]
