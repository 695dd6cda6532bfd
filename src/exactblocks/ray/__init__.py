"""exactblocks on Ray: batch inference on Ray Data, and a fleet of servers on Ray Serve.

- Ray Data (:mod:`exactblocks.ray.data`, the ``ray`` extra): :class:`Generate`, :class:`Score`
  and :class:`Embed`, callable classes for ``Dataset.map_batches`` whose every row is the bits
  of that row run alone; :func:`pack_model` ships a model through the object store.
- Ray Serve (:mod:`exactblocks.ray.serving`, the ``ray-serve`` extra): :func:`fleet_app`
  (a Serve application of N exactblocks engines behind one OpenAI-compatible ingress, with
  prefix-affinity routing, autoscaling on queue depth and failover that continues a stream
  with exactly the tokens an uninterrupted run gives) and :func:`run_fleet` (start it on a
  local or joined Ray cluster and serve HTTP). Imported only when asked for: Ray Data users
  need no Ray Serve.

docs/ray.md and docs/ray-serve.md say what is promised and how to run them.
"""

from .data import Embed, Generate, ModelLoadError, Score, pack_model, token_logprobs

__all__ = [
    "Embed",
    "Generate",
    "ModelLoadError",
    "PrefixAffinityRouter",
    "Score",
    "fleet_app",
    "pack_model",
    "run_fleet",
    "token_logprobs",
]

_SERVING = ("PrefixAffinityRouter", "fleet_app", "run_fleet")


def __getattr__(name):
    if name in _SERVING:  # imports ray.serve: only when asked for
        from . import serving

        return getattr(serving, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
