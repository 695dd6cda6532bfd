"""``exactblocks serve MODEL --ray-replicas N``: the same server as a fleet on Ray Serve.

Order of work, as for one process: the flags are checked (each message names its flag),
Ray Serve is imported, ``--host`` / ``--port`` are checked by binding them once (Ray Serve's
HTTP proxy binds them again), then Ray starts (or ``--ray-address`` is joined), the replicas
load the model and the ingress starts (:func:`exactblocks.ray.run_fleet`). Ctrl-C shuts the
application down and the command ends with status 130.
"""

from __future__ import annotations

import os
import sys
import time

from .common import FlagError, LoadError
from .models import resolve

__all__ = ["run_fleet_command"]


def _one_line(exc: BaseException) -> str:
    """A Ray deployment failure's cause in one line (its traceback ends with it)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln.split(":", 1)[0]:
            return ln
    return lines[-1] if lines else type(exc).__name__


def run_fleet_command(args, err=None) -> int:
    """Run ``exactblocks serve`` with ``--ray-replicas`` until interrupted.

    Parameters
    ----------
    args : argparse.Namespace
        The ``serve`` flags.
    err : text stream, default=sys.stderr

    Returns
    -------
    int
        2 when Ray Serve is not installed; otherwise it serves until Ctrl-C, which raises
        KeyboardInterrupt (status 130) after the application is shut down.

    Raises
    ------
    FlagError
        ``--threads`` (each replica runs ``--ray-cpus-per-replica`` threads),
        ``--ray-max-replicas`` below ``--ray-replicas``, ``--host`` / ``--port`` that cannot
        be bound, a ``--chat-template`` file that cannot be read.
    LoadError
        A replica or the ingress failed to start (the model cannot be loaded, a chat
        template that does not render): status 1.
    """
    err = err if err is not None else sys.stderr
    if args.threads is not None:
        raise FlagError("--threads", "with --ray-replicas each replica runs "
                        "--ray-cpus-per-replica threads; drop --threads")  # fmt: skip
    if args.ray_max_replicas is not None and args.ray_max_replicas < args.ray_replicas:
        raise FlagError("--ray-max-replicas", f"{args.ray_max_replicas} is below "
                        f"--ray-replicas {args.ray_replicas}")  # fmt: skip
    try:
        import fastapi  # noqa: F401
        import ray  # noqa: F401
        from ray import serve
    except ImportError as exc:
        print(f"exactblocks serve: {exc}; --ray-replicas needs the ray-serve extra: "
              "pip install 'exactblocks[ray-serve]'", file=err)  # fmt: skip
        return 2
    from exactblocks.ray import run_fleet

    from .serve import _bind, _read_template

    path = resolve(args.model)
    if not os.path.exists(path):
        raise FileNotFoundError(f"MODEL {args.model!r} does not exist")
    template = _read_template(args.chat_template)
    sock = _bind(args.host, args.port)  # the flags' errors before Ray starts
    port = sock.getsockname()[1]
    sock.close()
    name = args.model_name or os.path.basename(os.path.normpath(str(args.model)))
    scale = (f"{args.ray_replicas} to {args.ray_max_replicas}"
             if args.ray_max_replicas else f"{args.ray_replicas}")  # fmt: skip
    print(f"starting Ray Serve: {scale} replicas x {args.ray_cpus_per_replica} CPU(s) of "
          f"{path}", file=err)  # fmt: skip
    try:
        url = run_fleet(
            path,
            host=args.host,
            port=port,
            address=args.ray_address,
            replicas=args.ray_replicas,
            max_replicas=args.ray_max_replicas,
            cpus_per_replica=args.ray_cpus_per_replica,
            model_name=name,
            api_key=args.api_key,
            chat_template=template,
            tool_call_parser=args.tool_call_parser,
            prefix_affinity=args.ray_routing == "prefix",
            max_batch=args.max_batch,
            max_tokens_per_sequence=args.max_tokens_per_sequence,
            max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk,
            prefill_ratio=args.prefill_ratio,
            prefix_cache_mb=args.prefix_cache_mb,
        )
    except (ConnectionError, RuntimeError) as exc:  # Ray could not start it (a replica failed)
        _shutdown(serve)
        raise LoadError(RuntimeError(_one_line(exc))) from None
    print(f"serving {name!r} on {url}/v1 ({scale} replicas on Ray Serve)", file=err)
    err.flush()
    try:
        while True:
            time.sleep(3600)
    finally:
        _shutdown(serve)


def _shutdown(serve) -> None:
    try:
        serve.shutdown()
    except Exception:  # Ray is already gone
        pass
