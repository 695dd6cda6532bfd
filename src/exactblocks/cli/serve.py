"""``exactblocks serve``: check every flag, bind the port, load the model, report memory, serve.

Order of work, so that a mistake costs nothing: the flags are checked by argparse (each message
names its flag), the serve extra is imported, the listening socket is bound (``--host`` /
``--port`` errors, and ``--port 0``'s real port, before the model loads), then the model loads,
the server's memory is printed (and compared with the machine's available memory), and uvicorn
runs on the bound socket. Ctrl-C stops the server gracefully; the command then ends with
``exactblocks serve: interrupted`` and status 130, as the other commands do.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys

from exactblocks.serve import TOOL_CALL_PARSERS

from .common import FlagError, load, non_empty, non_negative_int
from .models import resolve

__all__ = [
    "add_parser",
    "available_memory",
    "memory_lines",
    "non_negative_mb",
    "non_negative_ratio",
    "port_number",
    "run_serve",
    "server_memory",
]


def port_number(text: str) -> int:
    """argparse type of ``--port``: an int in [0, 65535] (0 = a free port).

    Parameters
    ----------
    text : str

    Returns
    -------
    int

    Raises
    ------
    argparse.ArgumentTypeError
        Not an integer, or outside [0, 65535].
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 65535]; got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 65535]; got {value}")
    return value


def _non_negative(what: str):
    """argparse type: a finite float >= 0; ``what`` names it in the message ("a number of MiB")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} >= 0; got {text!r}") from None
        if not math.isfinite(value) or value < 0:
            finite = what.replace("a number", "a finite number", 1)
            raise argparse.ArgumentTypeError(f"expected {finite} >= 0; got {text!r}")
        return value

    return parse


#: argparse types of ``--prefix-cache-mb`` (MiB; 0 disables the cache) and ``--prefill-ratio``.
non_negative_mb = _non_negative("a number of MiB")
non_negative_ratio = _non_negative("a number")


def add_parser(sub, positive_int) -> None:
    """Add ``serve`` to the ``exactblocks`` subparsers.

    Parameters
    ----------
    sub : argparse subparsers action
    positive_int : callable
        The CLI's argparse type for integers >= 1.
    """
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible server (continuous batching, exact prefix cache)",
        description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/chat/completions, "
        "/v1/completions, /v1/models, /health, /metrics. A seeded request gets the same "
        "tokens and logprobs, bit for bit, alone or under any load.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="anything exactblocks.load_model accepts, or a bundled model's name "
        "(`exactblocks models`)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="port, 0 = a free one (default: 8000)"
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="exactblocks threads (default: CPUs available)",
    )
    p.add_argument(
        "--max-batch", type=positive_int, default=8, help="requests generating at once (default: 8)"
    )
    p.add_argument(
        "--max-tokens-per-sequence",
        type=positive_int,
        default=None,
        help="prompt + completion tokens per request (default: min(4096, the model's positions))",
    )
    p.add_argument(
        "--max-queue",
        type=non_negative_int,
        default=64,
        help="requests waiting for a batch row before 429 (default: 64)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=64,
        help="prompt tokens per row per step; prefix-cache boundary (default: 64)",
    )
    p.add_argument(
        "--prefill-ratio",
        type=non_negative_ratio,
        default=1.0,
        help="while requests decode, a step carries at most max(16, R x decoding requests) "
        "prompt tokens, bounding the per-token latency a prefill adds to about (1 + R) x a "
        "decode step; larger R = faster first tokens, slower others (default: 1.0)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_mb,
        default=256.0,
        help="prefix cache budget in MiB, 0 disables it (default: 256)",
    )
    p.add_argument(
        "--api-key",
        type=non_empty,
        default=os.environ.get("EXACTBLOCKS_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $EXACTBLOCKS_API_KEY, else none)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template file to render chats with instead of the model's own (e.g. "
        "one that renders tools); checked at start-up",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the tool-call syntax the model writes (default: read from the chat template)",
    )
    p.add_argument(
        "--model-name",
        type=non_empty,
        default=None,
        help="the model id clients send (default: MODEL's file or folder name)",
    )
    ray = p.add_argument_group(
        "Ray Serve (a fleet of replicas behind one ingress; needs the ray-serve extra)"
    )
    ray.add_argument(
        "--ray-replicas",
        type=positive_int,
        default=None,
        metavar="N",
        help="serve with N engine replicas on Ray Serve (the minimum when autoscaling)",
    )
    ray.add_argument(
        "--ray-max-replicas",
        type=positive_int,
        default=None,
        metavar="M",
        help="autoscale between --ray-replicas and M on queue depth (default: fixed N)",
    )
    ray.add_argument(
        "--ray-cpus-per-replica",
        type=positive_int,
        default=1,
        metavar="K",
        help="Ray CPUs per replica, = its threads (default: 1)",
    )
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join a running Ray cluster ('auto', or the head's address; default: start a "
        "local one); MODEL must be readable at the same path on every node",
    )
    ray.add_argument(
        "--ray-routing",
        choices=("prefix", "pow2"),
        default="prefix",
        help="prefix: to the replica caching the longest prefix unless queues are "
        "imbalanced; pow2: Ray Serve's power of two choices (default: prefix)",
    )


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's available memory in bytes (``MemAvailable``), or None where unknown.

    Parameters
    ----------
    meminfo : str, default="/proc/meminfo"
        The file to read (Linux).

    Returns
    -------
    int or None
    """
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def server_memory(model, max_batch: int, max_tokens: int, prefix_cache_mb: float) -> dict:
    """What a server of ``model`` holds besides the weights, from the model's layer shapes.

    Parameters
    ----------
    model : exactblocks.Model
    max_batch : int
        Rows of the engine's state (``--max-batch``).
    max_tokens : int
        Positions per row (``--max-tokens-per-sequence``, resolved).
    prefix_cache_mb : float
        The prefix cache budget in MiB.

    Returns
    -------
    dict
        ``kv_bytes_per_token`` (keys and values of every attention layer: sum over layers of
        2 x n_kv_heads x head_dim x 4 bytes), ``state_bytes`` (the engine's state:
        max_batch x the positions a row keeps x kv_bytes_per_token, a sliding-window layer
        keeping at most its window, plus each Mamba-2 layer's constant conv and SSM state per
        row), ``prefix_cache_bytes`` and ``total_bytes`` (their sum), and ``weight_bytes``
        (the packed weights, already loaded).
    """
    import exactblocks

    per_token = 0
    state = 0
    for blk in model.blocks:
        if isinstance(blk, exactblocks.Mamba2BlockInference):
            per_row = blk.conv_dim * blk.conv_kernel + blk.n_heads * blk.head_dim * blk.d_state
            state += max_batch * per_row * 4
            continue
        p = blk.get_params()
        kv = 2 * (p.get("n_kv_heads") or 0) * (p.get("head_dim") or 0) * 4
        window = p.get("window") or 0
        per_token += kv
        state += max_batch * (min(window, max_tokens) if window > 0 else max_tokens) * kv
    cache = int(prefix_cache_mb * 2**20)
    return {
        "kv_bytes_per_token": per_token,
        "state_bytes": state,
        "prefix_cache_bytes": cache,
        "total_bytes": state + cache,
        "weight_bytes": sum(model.weight_storage().values()),
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def memory_lines(mem: dict, max_batch: int, max_tokens: int, available: int | None) -> list:
    """The start-up lines on memory: the formula with its values, and a warning if it won't fit.

    Parameters
    ----------
    mem : dict
        :func:`server_memory`'s result.
    max_batch, max_tokens : int
    available : int or None
        :func:`available_memory` (after the model loaded), None when unknown.

    Returns
    -------
    list of str
    """
    if mem["kv_bytes_per_token"]:
        state = (
            f"state {max_batch} rows x {max_tokens} tokens x "
            f"{_size(mem['kv_bytes_per_token'])} KV per token = {_size(mem['state_bytes'])}"
        )
    else:  # Mamba-2 layers only: a constant state per row
        state = f"state {max_batch} rows x a constant state = {_size(mem['state_bytes'])}"
    lines = [
        f"memory: {state}, "
        f"+ prefix cache up to {_size(mem['prefix_cache_bytes'])} = {_size(mem['total_bytes'])} "
        f"beside the {_size(mem['weight_bytes'])} of weights"
        + ("" if available is None else f"; {_size(available)} available")
    ]
    if available is not None and mem["total_bytes"] > available:
        lines.append(
            f"warning: the server may use {_size(mem['total_bytes'])} as it fills, more than the "
            f"{_size(available)} this machine has available (MemAvailable); lower --max-batch, "
            "--max-tokens-per-sequence or --prefix-cache-mb"
        )
    return lines


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket of ``host:port``, bound now (uvicorn listens on it later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise FlagError("--host", f"cannot resolve {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        flag = "--port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
        raise FlagError(flag, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _read_template(path: str | None) -> str | None:
    """The text of ``--chat-template FILE`` (None without the flag)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise FlagError("--chat-template", f"cannot read {path!r}: {exc}") from None
    if not text.strip():
        raise FlagError("--chat-template", f"{path!r} is empty")
    return text


def _check_template(model, template: str, path: str) -> None:
    """Render a one-message conversation with ``--chat-template``'s text, or raise FlagError."""
    tok = model.tokenizer
    if tok is None:
        raise FlagError("--chat-template", "the model has no tokenizer to render chats with")
    try:
        tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                add_generation_prompt=True, chat_template=template)  # fmt: skip
    except Exception as exc:
        raise FlagError("--chat-template", f"{path!r} fails to render a one-message "
                        f"conversation: {type(exc).__name__}: {exc}") from None  # fmt: skip


def run_serve(args, err=None) -> int:
    """Run ``exactblocks serve`` until interrupted.

    Parameters
    ----------
    args : argparse.Namespace
        The ``serve`` flags.
    err : text stream, default=sys.stderr

    Returns
    -------
    int
        2 when the serve extra is missing. Otherwise the server runs until a signal; Ctrl-C
        (SIGINT) ends it gracefully and raises KeyboardInterrupt, which the command reports
        as one line with status 130.

    Raises
    ------
    ValueError
        A flag that cannot work (its ``flag`` attribute names it): ``--host`` or ``--port``
        that cannot be bound, ``--max-tokens-per-sequence`` above the model's positions, a
        ``--chat-template`` file that cannot be read or rendered.
    FileNotFoundError, ImportError, MemoryError, TypeError
        As :func:`exactblocks.load_model`.
    """
    err = err if err is not None else sys.stderr
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(
            f"exactblocks serve: {exc}; install the serve extra: pip install 'exactblocks[serve]'",
            file=err,
        )
        return 2
    ray_flags = [f for f, v in (("--ray-max-replicas", args.ray_max_replicas),
                                ("--ray-address", args.ray_address)) if v is not None]  # fmt: skip
    if args.ray_replicas is None:
        if ray_flags:
            raise FlagError(ray_flags[0], "needs --ray-replicas N (a Ray Serve fleet)")
    else:
        from .serve_ray import run_fleet_command

        return run_fleet_command(args, err)
    from exactblocks.serve.cli import build_server

    path = resolve(args.model)
    template = _read_template(args.chat_template)
    sock = _bind(args.host, args.port)
    try:
        model = load(path, args.threads, err)
        limit = model.max_positions
        max_tokens = args.max_tokens_per_sequence
        if max_tokens is not None and limit is not None and max_tokens > limit:
            raise FlagError(
                "--max-tokens-per-sequence",
                f"{max_tokens} exceeds the model's max_positions={limit}",
            )
        name = args.model_name or os.path.basename(os.path.normpath(str(args.model)))
        if template is not None:
            _check_template(model, template, args.chat_template)
        server = build_server(
            model,
            host=args.host,
            port=args.port,
            model_name=name,
            api_key=args.api_key,
            log_level="info",
            chat_template=template,
            tool_call_parser=args.tool_call_parser,
            max_batch=args.max_batch,
            max_tokens_per_sequence=max_tokens,
            max_queue=args.max_queue,
            prefill_chunk=args.prefill_chunk,
            prefill_ratio=args.prefill_ratio,
            prefix_cache_mb=args.prefix_cache_mb,
        )
        # the engine's own sizes (its default sequence length included); its state's pages
        # are not resident yet: they fill as requests do
        engine = server.config.app.state.engine
        rows, max_tokens = engine.max_batch, engine.max_tokens_per_sequence
        mem = server_memory(model, rows, max_tokens, args.prefix_cache_mb)
        for line in memory_lines(mem, rows, max_tokens, available_memory()):
            print(line, file=err)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        startup = server.startup

        async def startup_then_announce(sockets=None):
            await startup(sockets)  # listening from here: the line is true when it shows
            if server.started:
                print(f"serving {name!r} on http://{shown}:{port}/v1", file=err)
                err.flush()

        server.startup = startup_then_announce
        server.run(sockets=[sock])  # uvicorn raises KeyboardInterrupt again after shutting down
    finally:
        sock.close()
    return 0
