"""A fleet of exactblocks engines on Ray Serve, behind one OpenAI-compatible ingress.

What lives here: :func:`fleet_app` (the Serve application: an ``Ingress`` deployment running
the same FastAPI app as ``exactblocks serve``, N ``EngineReplica`` deployments each running an
:class:`exactblocks.serve.Engine` on its own CPUs, and a ``Registry`` deployment the replicas
report their gauges to), :class:`PrefixAffinityRouter` (a Ray Serve ``RequestRouter``: a
request goes to the replica that caches its longest prefix unless the queues are imbalanced)
and :func:`run_fleet` (start the application on a local or joined Ray cluster and serve HTTP).
What does not: the HTTP routes, the request checks and the OpenAI shapes (the app of
``exactblocks.serve.api``, used unchanged), scheduling and sampling (each replica's engine).

Why the answers do not depend on the fleet: a request's tokens and logprobs depend only on
the model file, the numeric options, the request and its seed (SPEC.md 3.1 and 5), never on
the replica, its batch, its slot or its prefix cache, so a fleet answers every request with
the bits of one ``exactblocks serve`` process; the router only changes where the work runs
and how much is recomputed. A request without a seed that samples gets a seed drawn at the
ingress (fresh entropy, as a single server's draws are), so that it too can be resumed.

Failover: the ingress keeps the tokens each request has sent. When a replica is lost
mid-request (its actor died or became unreachable), it re-issues the request to another
replica with ``resume=`` those tokens (``Engine.submit``): the new replica runs the prompt
plus them, the sampler continues at the same draw (PCG64 advanced by one draw per token), and
the stream goes on with exactly the events the uninterrupted run sends. A request is retried
on at most :data:`RETRIES` lost replicas, then ends with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import secrets
import threading
import time
from collections import OrderedDict

import numpy as np
import ray
import xxhash
from ray import serve
from ray.serve.request_router import LocalityMixin, MultiplexMixin, RequestRouter

import exactblocks
from exactblocks.serve import (
    Engine,
    EngineClosed,
    FinishEvent,
    PromptEvent,
    QueueFull,
    SamplingParams,
    TokenEvent,
    check_sizes,
    prepare_request,
)

from .data import ModelLoadError, _assigned_cpus, _unpack

__all__ = ["PrefixAffinityRouter", "fleet_app", "prefix_hashes", "run_fleet"]

#: Lost replicas a request is re-issued past before it ends with an error.
RETRIES = 4
#: Seconds between a replica's reports of its gauges to the registry.
REPORT_SECONDS = 1.0
#: A replica whose last report is older than this is left out of ``/metrics``.
STALE_SECONDS = 10.0
#: Autoscaling defaults (Ray Serve's ``autoscaling_config``) when ``max_replicas`` exceeds
#: ``replicas``: the target of requests in flight per replica is its engine's ``max_batch``.
UPSCALE_DELAY_S = 2.0
DOWNSCALE_DELAY_S = 30.0


def prefix_hashes(ids, block: int) -> list[int]:
    """Chained 64-bit hashes of the whole ``block``-token prefixes of ``ids``.

    Parameters
    ----------
    ids : sequence of int or ndarray of int64
        Token ids.
    block : int
        The prefix cache's boundary spacing (the engine's ``prefill_chunk``).

    Returns
    -------
    list of int
        ``h[k]`` hashes ``ids[: (k + 1) * block]``: xxh64 of block k's int64 bytes seeded
        with ``h[k - 1]`` (0 for the first), so equal prefixes hash equal on every process.
    """
    arr = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    out, h = [], 0
    for k in range(len(arr) // block):
        h = xxhash.xxh64_intdigest(arr[k * block : (k + 1) * block].tobytes(), seed=h)
        out.append(h)
    return out


# -- the replica --------------------------------------------------------------------------------


class _Bursts:
    """Engine events (from its loop thread) into per-request asyncio queues, one list per
    burst: what one step sent a request arrives as one item, so a stream is never cut inside
    a step's events."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: dict = {}  # queue -> events of this burst

    def sink(self, queue: asyncio.Queue):
        def put(ev) -> None:
            with self.lock:
                self.pending.setdefault(queue, []).append(ev)

        return put

    def kick(self) -> None:
        with self.lock:
            items, self.pending = self.pending, {}
        if items:
            self.loop.call_soon_threadsafe(self._deliver, items)

    @staticmethod
    def _deliver(items: dict) -> None:
        for queue, events in items.items():
            queue.put_nowait(events)


class EngineReplica:
    """One replica of the fleet: the model and an :class:`exactblocks.serve.Engine` on it.

    Parameters
    ----------
    model : str or None
        A model path every node can see (anything :func:`exactblocks.load_model` accepts).
    model_ref : dict or None
        :func:`exactblocks.ray.pack_model`'s dict (Ray resolves an ``ObjectRef`` passed at
        bind time), written to a temporary folder here and loaded.
    engine_options : dict
        Keyword arguments of :class:`exactblocks.serve.Engine` (``max_batch``,
        ``max_tokens_per_sequence``, ``max_queue``, ``prefill_chunk``, ``prefill_ratio``,
        ``prefix_cache_mb``).
    load_options : dict
        Keyword arguments of :func:`exactblocks.load_model`.
    registry : DeploymentHandle or None
        The fleet's ``Registry``: the replica reports :meth:`stats` to it every
        :data:`REPORT_SECONDS`.

    Notes
    -----
    Threads: the CPUs Ray assigned to the replica (``ray_actor_options={"num_cpus": k}``).

    Raises
    ------
    ModelLoadError
        The model cannot be loaded (the message names the path).
    """

    def __init__(self, model=None, model_ref=None, *, engine_options=None, load_options=None,
                 registry=None):  # fmt: skip
        self._tmp = None
        if model_ref is not None:
            if isinstance(model_ref, ray.ObjectRef):  # (Ray passes a nested ref unresolved)
                model_ref = ray.get(model_ref)
            path, self._tmp = _unpack(model_ref)
        else:
            path = os.fspath(model)
        cpus = _assigned_cpus()
        if cpus is not None:
            exactblocks.set_num_threads(cpus)
        try:
            self.model = exactblocks.load_model(path, **(load_options or {}))
        except Exception as exc:
            raise ModelLoadError(
                f"exactblocks.ray: a replica cannot load the model {path!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        self.engine = Engine(self.model, **(engine_options or {})).start()
        self._bursts: _Bursts | None = None
        self._registry = registry
        self._reporter: asyncio.Task | None = None
        self.replica_id = _replica_id()

    def _loop_ready(self) -> _Bursts:
        if self._bursts is None:
            self._bursts = _Bursts(asyncio.get_running_loop())
            self.engine.add_burst_hook(self._bursts.kick)
            if self._registry is not None:
                self._reporter = asyncio.get_running_loop().create_task(self._report())
        return self._bursts

    async def _report(self) -> None:
        while True:
            try:
                await self._registry.report.remote(self.replica_id, self.stats())
            except Exception:  # the registry restarts: report again next time
                pass
            await asyncio.sleep(REPORT_SECONDS)

    async def describe(self) -> dict:
        """What the ingress needs of the model and the engine (no weights).

        Returns
        -------
        dict
            ``tokenizer`` (the model's, pickled by Ray), ``vocab_size``, ``eos_token_ids``,
            ``fingerprint``, ``family``, ``max_positions``, ``max_tokens_per_sequence``,
            ``max_batch``, ``prefill_chunk``.
        """
        self._loop_ready()
        m, e = self.model, self.engine
        return {
            "tokenizer": m.tokenizer,
            "vocab_size": m.vocab_size,
            "eos_token_ids": list(m.eos_token_ids),
            "fingerprint": m.fingerprint,
            "family": m.family,
            "max_positions": m.max_positions,
            "max_tokens_per_sequence": e.max_tokens_per_sequence,
            "max_batch": e.max_batch,
            "prefill_chunk": e.prefill_chunk,
        }

    async def generate(self, request: dict):
        """Run one request; yield ``{"accepted": replica_id}`` (or ``{"refused": kind,
        "message": ..}``), then one list of engine events per step, the last ending with
        the FinishEvent. Cancelling the stream cancels the request.

        ``request``: ``ids``, ``params`` (SamplingParams), ``prompt_logprobs``,
        ``prefill_only``, ``resume`` (as :meth:`exactblocks.serve.Engine.submit`).
        """
        bursts = self._loop_ready()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            handle = self.engine.submit(
                request["ids"], request["params"], bursts.sink(queue),
                prompt_logprobs=request.get("prompt_logprobs"),
                prefill_only=bool(request.get("prefill_only")),
                resume=request.get("resume") or (),
            )  # fmt: skip
        except QueueFull as exc:
            yield {"refused": "queue_full", "message": str(exc), "retry_after": exc.retry_after}
            return
        except EngineClosed as exc:
            yield {"refused": "closed", "message": str(exc)}
            return
        except ValueError as exc:
            yield {"refused": "invalid", "message": str(exc)}
            return
        yield {"accepted": self.replica_id}
        try:
            while True:
                events = await queue.get()
                while not queue.empty():  # steps the ingress has not read yet: one message
                    events = events + queue.get_nowait()
                yield events
                if isinstance(events[-1], FinishEvent):
                    return
        finally:
            if handle.finished is None:
                handle.cancel()

    async def hidden_states(self, ids, lengths=None) -> np.ndarray:
        """:meth:`exactblocks.Model.hidden_states` on this replica (for ``/v1/embeddings``)."""
        return await asyncio.to_thread(self.model.hidden_states, ids, lengths=lengths)

    def stats(self) -> dict:
        """The engine's :meth:`~exactblocks.serve.Engine.stats`."""
        return self.engine.stats()

    def record_routing_stats(self) -> dict:
        """What :class:`PrefixAffinityRouter` reads (Ray Serve calls this periodically):
        ``prefixes`` (:func:`prefix_hashes` of every cached prefix's whole blocks),
        ``block`` (the engine's ``prefill_chunk``)."""
        block = self.engine.prefill_chunk
        found: set = set()
        for ids in self.engine.cached_prefixes():
            hashes = prefix_hashes(ids, block)
            if hashes:
                found.add(hashes[-1])
        return {"prefixes": sorted(found), "block": block}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=2.0)
        if getattr(self, "_tmp", None):
            import shutil

            shutil.rmtree(self._tmp, ignore_errors=True)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (a unit use of the class)
        return f"local-{os.getpid()}"


class Registry:
    """The fleet's gauges: each replica's last :meth:`EngineReplica.stats` report."""

    def __init__(self):
        self._reports: dict = {}

    def report(self, replica: str, stats: dict) -> None:
        """Record ``stats`` of ``replica`` now."""
        self._reports[replica] = (time.monotonic(), stats)

    def snapshot(self) -> dict:
        """``{replica: stats}`` of the replicas that reported within :data:`STALE_SECONDS`."""
        now = time.monotonic()
        for r in [r for r, (t, _) in self._reports.items() if now - t > STALE_SECONDS]:
            del self._reports[r]
        return {r: s for r, (_, s) in self._reports.items()}


# -- the router ---------------------------------------------------------------------------------


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Route a request to the replica caching its longest prefix, unless that replica's
    queue is longer than the shortest by more than ``imbalanced_threshold``; otherwise
    (no cached prefix, or imbalance) Ray Serve's power-of-two choices.

    A replica "caches" a prefix when its last routing stats list it
    (:meth:`EngineReplica.record_routing_stats`) or when this router sent it a request
    with that prefix since (kept for the ``remember`` most recent prefixes per replica).
    The choice never changes an answer: every replica gives the same bits.

    Parameters (``request_router_kwargs``)
    --------------------------------------
    block : int, default=64
        The engines' ``prefill_chunk`` (prefix-cache boundary spacing).
    imbalanced_threshold : int, default=4
        Requests in flight by which the prefix's replica may exceed the least loaded one.
    remember : int, default=4096
        Prefixes remembered per replica from this router's own choices.
    """

    def initialize_state(self, **kwargs) -> None:
        self._block = int(kwargs.get("block", 64))
        self._threshold = int(kwargs.get("imbalanced_threshold", 4))
        self._remember = int(kwargs.get("remember", 4096))
        self._routed: dict = {}  # replica id -> OrderedDict of prefix hashes

    def _two_choices(self, pending) -> list:
        """Ray Serve's power-of-two choices: two random replicas (after its locality and
        multiplexing preferences), the less loaded of them taken by Serve."""
        if pending is not None and pending.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending)
        else:
            ids = self.apply_locality_routing(pending_request=pending)
        pool = list(ids)
        if not pool:
            return []
        chosen = random.sample(pool, min(2, len(pool)))
        return [[self._replicas[i] for i in chosen]]

    def _hashes(self, pending) -> list:
        if pending is None or not pending.args:
            return []
        req = pending.args[0]
        ids = req.get("ids") if isinstance(req, dict) else None
        if ids is None:
            return []
        return prefix_hashes(ids, self._block)

    def _match(self, replica, hashes: list) -> int:
        stats = replica.routing_stats or {}
        have = stats.get("prefixes") or ()
        have = have if isinstance(have, set) else set(have)
        mine = self._routed.get(replica.replica_id, {})
        for k in range(len(hashes), 0, -1):
            if hashes[k - 1] in have or hashes[k - 1] in mine:
                return k
        return 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        fallback = self._two_choices(pending_request)
        hashes = self._hashes(pending_request)
        if not hashes or not candidate_replicas:
            return fallback
        scored = [(self._match(r, hashes), r) for r in candidate_replicas]
        best = max(k for k, _ in scored)
        if best == 0:
            return fallback
        chosen = [r for k, r in scored if k == best]
        lens = [self._replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas]
        known = [q for q in lens if q is not None]
        if known:
            least = min(known)
            chosen = [
                r for r in chosen
                if (self._replica_queue_len_cache.get(r.replica_id) or 0) - least
                <= self._threshold
            ]  # fmt: skip
        if not chosen:
            return fallback
        return [chosen] + fallback

    def on_request_routed(self, pending_request, replica_id, result):
        hashes = self._hashes(pending_request)
        if not hashes:
            return
        mine = self._routed.setdefault(replica_id, OrderedDict())
        for h in hashes:
            mine[h] = None
            mine.move_to_end(h)
        while len(mine) > self._remember:
            mine.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self._routed.pop(replica_id, None)


# -- the ingress --------------------------------------------------------------------------------


class _RemoteModel:
    """What the ingress's routes read of the model: a replica's :meth:`EngineReplica.describe`,
    and ``hidden_states`` run on a replica."""

    def __init__(self, info: dict, replicas):
        self.tokenizer = info["tokenizer"]
        self.vocab_size = info["vocab_size"]
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.fingerprint = info["fingerprint"]
        self.family = info["family"]
        self.max_positions = info["max_positions"]
        self._replicas = replicas

    def generation(self, prompt_ids, params, *, where, resume=()):
        from exactblocks.models.generate import Generation

        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: params must be a SamplingParams")
        return Generation(params, prompt_ids, tokenizer=self.tokenizer,
                          eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size,
                          where=where, resume=resume)  # fmt: skip

    def hidden_states(self, ids, lengths=None) -> np.ndarray:
        # called on a worker thread (the embeddings route's asyncio.to_thread)
        return self._replicas.hidden_states.remote(ids, lengths).result()


class _FleetHandle:
    """The ingress's handle of one request: ``finished``, ``cancel()``, ``replica`` (the
    replica now serving it) and ``replicas`` (every one it ran on)."""

    def __init__(self):
        self.finished: float | None = None
        self.replicas: list[str] = []
        self.task: asyncio.Task | None = None
        self.stream = None

    @property
    def replica(self) -> str | None:
        return self.replicas[-1] if self.replicas else None

    def cancel(self) -> None:
        if self.finished is None:
            self.finished = time.perf_counter()
            if self.task is not None:
                self.task.cancel()
            if self.stream is not None:
                self.stream.cancel()


def _lost(exc: BaseException) -> bool:
    """True when ``exc`` means the replica is gone (its actor died or is unreachable)."""
    import ray.exceptions as rex

    return isinstance(exc, (rex.RayActorError, rex.ActorUnavailableError))


class FleetEngine:
    """The engine interface of :func:`exactblocks.serve.create_app` over the fleet's replicas.

    Submissions are checked here exactly as :meth:`exactblocks.serve.Engine.submit` checks
    them (:func:`exactblocks.serve.prepare_request`), then streamed from a replica the
    router picks; a replica lost mid-request is replaced by another with ``resume=`` the
    tokens already sent (module docstring).

    Parameters
    ----------
    replicas : ray.serve.handle.DeploymentHandle
        The ``EngineReplica`` deployment.
    registry : ray.serve.handle.DeploymentHandle
        The ``Registry`` deployment.
    info : dict
        :meth:`EngineReplica.describe` of one replica.
    """

    def __init__(self, replicas, registry, info: dict):
        self._replicas = replicas
        self._streams = replicas.options(stream=True)
        self._registry = registry
        self.model = _RemoteModel(info, replicas)
        self.max_tokens_per_sequence = info["max_tokens_per_sequence"]
        self.max_batch = info["max_batch"]
        self.prefill_chunk = info["prefill_chunk"]
        self._hooks: list = []
        self._live: set = set()
        self._snapshot: dict = {}
        self.counters = {"failovers": 0}

    # the Engine interface create_app uses
    @property
    def alive(self) -> bool:
        return True  # the replicas are Ray Serve's to keep alive (and restart)

    def start(self) -> FleetEngine:
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        for h in list(self._live):
            h.cancel()

    def check(self, n_prompt: int, max_tokens: int | None) -> int:
        return check_sizes(self.max_tokens_per_sequence, n_prompt, max_tokens)

    def add_burst_hook(self, hook) -> None:
        self._hooks.append(hook)

    async def asubmit(self, prompt_ids, params: SamplingParams, sink, *, prompt_logprobs=None,
                      prefill_only=False) -> _FleetHandle:  # fmt: skip
        """Check and start one request; raise as :meth:`exactblocks.serve.Engine.submit`."""
        ids, _, _ = prepare_request(
            self.model, self.max_tokens_per_sequence, prompt_ids, params,
            prompt_logprobs=prompt_logprobs, prefill_only=prefill_only,
        )  # fmt: skip
        if params.temperature > 0 and params.seed is None:
            # fresh entropy, drawn once here: a re-issued request continues the same draws
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        request = {"ids": ids.tolist(), "params": params, "prompt_logprobs": prompt_logprobs,
                   "prefill_only": bool(prefill_only), "resume": []}  # fmt: skip
        handle = _FleetHandle()
        stream = await self._open(handle, request)
        handle.task = asyncio.get_running_loop().create_task(
            self._pump(handle, request, stream, sink)
        )
        self._live.add(handle)
        return handle

    async def _open(self, handle: _FleetHandle, request: dict):
        """Start ``request`` on a replica; return its stream once the replica accepted it."""
        from ray.serve.exceptions import BackPressureError

        try:
            stream = self._streams.generate.remote(request)
            handle.stream = stream
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise QueueFull(f"every replica is busy: {exc}", retry_after=1) from None
        if "refused" in first:
            kind, message = first["refused"], first["message"]
            if kind == "queue_full":
                raise QueueFull(message, retry_after=first.get("retry_after", 1))
            if kind == "closed":
                raise EngineClosed(message)
            raise ValueError(message)
        handle.replicas.append(first["accepted"])
        return stream

    async def _pump(self, handle: _FleetHandle, request: dict, stream, sink) -> None:
        sent: list[int] = []  # the tokens of the TokenEvents delivered so far
        prompt_sent = False
        lost = 0
        try:
            while True:
                try:
                    async for events in stream:
                        for ev in events:
                            if isinstance(ev, TokenEvent):
                                sent.append(ev.token)
                            elif isinstance(ev, PromptEvent):
                                prompt_sent = True
                            elif isinstance(ev, FinishEvent):
                                handle.finished = time.perf_counter()
                            sink(ev)
                        for hook in self._hooks:
                            hook()
                        if handle.finished is not None:
                            return
                    raise RuntimeError("the replica's stream ended before its finish")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not (_lost(exc) or isinstance(exc, RuntimeError)):
                        self._fail(handle, sink, f"the replica failed: {type(exc).__name__}: "
                                   f"{exc}")  # fmt: skip
                        return
                    if lost >= RETRIES:
                        self._fail(handle, sink, f"the request lost {lost + 1} replicas, the "
                                   f"last with {type(exc).__name__}: {exc}")  # fmt: skip
                        return
                    lost += 1
                    self.counters["failovers"] += 1
                    again = dict(request, resume=list(sent))
                    if prompt_sent:  # its prompt logprobs were sent: only tokens remain
                        again["prompt_logprobs"] = None
                    if again["resume"] and again["prompt_logprobs"] is not None:
                        again["resume"] = []  # never here: prompt events precede tokens
                    stream = await self._reopen(handle, again, lost)
                    if stream is None:
                        self._fail(handle, sink, "no replica took the re-issued request")
                        return
        finally:
            self._live.discard(handle)

    async def _reopen(self, handle: _FleetHandle, request: dict, attempt: int):
        for wait in (0.2, 0.5, 1.0, 2.0, 4.0):
            await asyncio.sleep(wait * attempt)
            try:
                return await self._open(handle, request)
            except QueueFull:
                continue
            except Exception as exc:
                if not _lost(exc):
                    return None
        return None

    def _fail(self, handle: _FleetHandle, sink, message: str) -> None:
        handle.finished = time.perf_counter()
        sink(FinishEvent("error", error=message))
        for hook in self._hooks:
            hook()

    # metrics
    async def refresh(self) -> None:
        """Read every replica's last report from the registry (``/metrics`` calls this)."""
        self._snapshot = await self._registry.snapshot.remote()

    def stats(self) -> dict:
        """The replicas' stats summed (gauges and counters; ``kv_cache_usage`` averaged),
        with ``replicas`` (how many reported) and ``failovers_total``."""
        reports = list(self._snapshot.values())
        out: dict = {}
        for rep in reports:
            for k, v in rep.items():
                out[k] = out.get(k, 0) + v
        if reports:
            out["kv_cache_usage"] = out.get("kv_cache_usage", 0.0) / len(reports)
        for key in ("running", "waiting", "kv_cache_usage", "max_batch", "prefix_cache_bytes",
                    "prefix_cache_entries"):  # fmt: skip
            out.setdefault(key, 0)
        out["replicas"] = len(reports)
        out["failovers_total"] = self.counters["failovers"]
        return out

    def replica_stats(self) -> dict:
        """``{replica: stats}`` of the last :meth:`refresh` (``/metrics`` labels by replica)."""
        return dict(self._snapshot)


class Ingress:
    """The fleet's HTTP ingress: :func:`exactblocks.serve.create_app` over a
    :class:`FleetEngine` (the same routes, checks, errors and options as ``exactblocks
    serve``). Built by :func:`fleet_app`; Ray Serve wraps it with ``serve.ingress``."""

    async def __init__(self, replicas, registry, *, model_name: str, api_key=None,  # type: ignore[misc]
                       chat_template=None, tool_call_parser=None):  # fmt: skip
        info = await replicas.describe.remote()
        self._fleet = FleetEngine(replicas, registry, info)
        self._app_options = {"model_name": model_name, "api_key": api_key,
                             "chat_template": chat_template,
                             "tool_call_parser": tool_call_parser}  # fmt: skip

    def __serve_build_asgi_app__(self):
        from exactblocks.serve import create_app

        return create_app(self._fleet, **self._app_options)


def _positive(name: str, value, *, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"exactblocks.ray.fleet_app: {name} must be an int >= 1; got {value!r}")
    return value


def fleet_app(model=None, *, model_ref=None, replicas: int = 1, max_replicas: int | None = None,
              cpus_per_replica: int = 1, model_name: str | None = None, api_key=None,
              chat_template: str | None = None, tool_call_parser: str | None = None,
              prefix_affinity: bool = True, autoscaling: dict | None = None,
              load_options: dict | None = None, **engine_options):  # fmt: skip
    """The Ray Serve application of a fleet: N engine replicas behind one ingress.

    Parameters
    ----------
    model : str or os.PathLike or None
        A model path every node of the cluster can read (anything
        :func:`exactblocks.load_model` accepts).
    model_ref : ray.ObjectRef or dict or None
        Instead of ``model``: ``ray.put(exactblocks.ray.pack_model(path))``, the model's
        bytes in the object store (each replica writes them to a temporary folder).
    replicas : int, default=1
        Replicas to run (the minimum when autoscaling).
    max_replicas : int or None, default=None
        More than ``replicas``: autoscale between the two on queue depth (Ray Serve's
        ``autoscaling_config``: ``target_ongoing_requests`` = ``max_batch`` per replica,
        ``upscale_delay_s`` = :data:`UPSCALE_DELAY_S`, ``downscale_delay_s`` =
        :data:`DOWNSCALE_DELAY_S`). None = a fixed ``replicas``.
    cpus_per_replica : int, default=1
        Ray CPUs per replica; its engine runs that many threads.
    model_name : str or None
        The model id clients send (default: the file or folder name).
    api_key, chat_template, tool_call_parser
        As :func:`exactblocks.serve.create_app`.
    prefix_affinity : bool, default=True
        Route with :class:`PrefixAffinityRouter` (False: Ray Serve's power-of-two choices).
    autoscaling : dict or None
        Keys of Ray Serve's ``autoscaling_config`` that override the defaults above.
    load_options : dict or None
        Keyword arguments of :func:`exactblocks.load_model` (e.g. ``max_positions``).
    **engine_options
        Keyword arguments of :class:`exactblocks.serve.Engine`: ``max_batch`` (default 8),
        ``max_tokens_per_sequence``, ``max_queue``, ``prefill_chunk`` (default 64),
        ``prefill_ratio``, ``prefix_cache_mb``.

    Returns
    -------
    ray.serve.Application
        Run it with ``serve.run(app, route_prefix="/")`` or :func:`run_fleet`.

    Raises
    ------
    TypeError
        Neither or both of ``model`` and ``model_ref``; an unknown engine option.
    ValueError
        ``replicas``, ``max_replicas`` or ``cpus_per_replica`` not an int >= 1, or
        ``max_replicas < replicas``.
    FileNotFoundError
        ``model`` is a path that does not exist here (a cluster's nodes must see it too).
    """
    where = "exactblocks.ray.fleet_app"
    if (model is None) == (model_ref is None):
        raise TypeError(f"{where}: give exactly one of model= (a path every node can see) and "
                        "model_ref= (ray.put(exactblocks.ray.pack_model(path)))")  # fmt: skip
    if model is not None:
        model = os.fspath(model)
        if not os.path.exists(model):
            raise FileNotFoundError(f"{where}: the model {model!r} does not exist")
    replicas = _positive("replicas", replicas)
    max_replicas = _positive("max_replicas", max_replicas, allow_none=True)
    cpus = _positive("cpus_per_replica", cpus_per_replica)
    if max_replicas is not None and max_replicas < replicas:
        raise ValueError(f"{where}: max_replicas={max_replicas} is below replicas={replicas}")
    known = {"max_batch", "max_tokens_per_sequence", "max_queue", "prefill_chunk",
             "prefill_ratio", "prefix_cache_mb"}  # fmt: skip
    unknown = sorted(set(engine_options) - known)
    if unknown:
        raise TypeError(f"{where}: unknown engine option(s) {unknown}; expected {sorted(known)}")
    max_batch = engine_options.setdefault("max_batch", 8)
    max_queue = engine_options.get("max_queue", 64)
    block = engine_options.setdefault("prefill_chunk", 64)
    if model_name is None and model is not None:
        model_name = os.path.basename(os.path.normpath(model))
    elif model_name is None:
        name = model_ref.get("name") if isinstance(model_ref, dict) else None
        model_name = name or "model"  # (an ObjectRef is not read here: "model")

    quiet = {"enable_access_log": False}  # the reports every second and the stream calls
    registry = serve.deployment(name="Registry", ray_actor_options={"num_cpus": 0},
                                logging_config=quiet)(Registry).bind()  # fmt: skip
    options: dict = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": cpus},
        # the router never sends a replica more than its engine takes (rows + its queue);
        # beyond that, max_queue more wait at the ingress, then 429 (BackPressureError)
        "max_ongoing_requests": max_batch + max_queue,
        "max_queued_requests": max(1, max_queue),
        "logging_config": quiet,
    }
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {
            "min_replicas": replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": max_batch,
            "upscale_delay_s": UPSCALE_DELAY_S,
            "downscale_delay_s": DOWNSCALE_DELAY_S,
            **(autoscaling or {}),
        }
    else:
        options["num_replicas"] = replicas
    if prefix_affinity:
        from ray.serve.config import RequestRouterConfig

        router: dict = {"request_router_class": PrefixAffinityRouter,
                        "request_router_kwargs": {"block": block},
                        "request_routing_stats_period_s": 1.0}  # fmt: skip
        options["request_router_config"] = RequestRouterConfig(**router)
    engines = serve.deployment(**options)(EngineReplica).bind(
        model, model_ref, engine_options=engine_options, load_options=load_options,
        registry=registry,
    )  # fmt: skip
    # every request of every replica, and those waiting, pass through the one ingress (Ray
    # Serve's default of 5 at once would cap the fleet)
    most = (max_replicas or replicas) * (max_batch + max_queue) + max(1, max_queue)
    ingress = serve.deployment(
        name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=most
    )(serve.ingress()(Ingress))
    return ingress.bind(engines, registry, model_name=model_name, api_key=api_key,
                        chat_template=chat_template, tool_call_parser=tool_call_parser)  # fmt: skip


def run_fleet(
    model=None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    app_name: str = "exactblocks",
    **fleet_options,
) -> str:
    """Start :func:`fleet_app` on Ray Serve and serve it over HTTP; return its base URL.

    Parameters
    ----------
    model : str or os.PathLike or None
        As :func:`fleet_app` (or give ``model_ref=``).
    host, port
        Where Ray Serve's HTTP proxy listens (every node of the cluster runs one).
    address : str or None, default=None
        A running cluster to join (``ray start --head`` prints it; ``"auto"`` finds a local
        one). None: the Ray already initialised in this process, else a new local one.
    app_name : str, default="exactblocks"
        The Serve application's name (one fleet per name).
    **fleet_options
        As :func:`fleet_app`.

    Returns
    -------
    str
        ``http://host:port`` (the OpenAI routes are under ``/v1``).

    Raises
    ------
    As :func:`fleet_app`; Ray's errors when the cluster cannot be reached or a replica fails
    to start (its :class:`~exactblocks.ray.ModelLoadError` included).
    """
    import ray

    app = fleet_app(model, **fleet_options)  # its checks first: nothing starts on bad options
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=app_name, route_prefix="/", blocking=False)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"
