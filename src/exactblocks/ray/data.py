"""Ray Data batch inference whose answers do not depend on how the work is split.

(``exactblocks.ray.data``; its names are re-exported by ``exactblocks.ray``.)

Three callable classes for ``Dataset.map_batches``: :class:`Generate` (text from a prompt or a
chat), :class:`Score` (log-probabilities of a given continuation) and :class:`Embed` (a pooled
hidden state). Each actor loads the model once in ``__init__`` (from a path every node can see,
or from bytes shipped through Ray's object store, :func:`pack_model`), uses as many threads as
it was given CPUs, and runs every row of a batch through the model together, with ragged
``lengths``: continuous batching within the batch, where a row that finishes frees its slot for
the next waiting row. ``__call__`` is pure: the same rows give the same outputs.

Invariance: exactblocks computes a row's logits with bits that depend neither on the other rows
of a call, the thread count nor the CPU's instruction set (SPEC.md 3.1); sampling draws from
``numpy.random.Generator(PCG64(seed))`` per row over probabilities built with the library's own
``exp``; log-probabilities use the library's ``exp`` / ``log1p`` and sequential float64 sums.
Generation runs on the library's one generation core (``exactblocks.models.generate``: the
sampling checks, stop rules and logprobs of ``Model.generate`` and the server).
So every row's output is bit-identical whatever the number of actors, the batch size, the row
order, the threads per actor or the machine (docs/ray.md).

Bad rows (a wrong type, an empty or too long prompt, an option out of range) do not fail the
job: the row's ``error`` column holds the message (None on good rows) and its outputs are empty
(``generated_text`` None, ``generated_ids`` empty, ``embedding`` NaN, ...). A model that cannot
be loaded fails the job with :class:`ModelLoadError`, which names the path.

The model is reached through its public calls only: ``Model.forward`` (generation),
``Model.hidden_states`` and ``Model.logits`` (scores and embeddings), each running the layers in
one native call.
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["Embed", "Generate", "ModelLoadError", "Score", "pack_model", "token_logprobs"]

_MISSING = object()


class ModelLoadError(RuntimeError):
    """The model of an actor could not be loaded; the message names the path and the cause."""


# -- loading ------------------------------------------------------------------------------------


def pack_model(path: str | os.PathLike) -> dict:
    """Read a model file or folder into one object to ship through Ray's object store.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.gguf`` or ``.safetensors`` file, or a ``save_pretrained`` folder (its files, not
        its subfolders).

    Returns
    -------
    dict
        ``{"name": basename, "is_dir": bool, "files": {name: bytes}}``; pass
        ``model_ref=ray.put(pack_model(path))`` to :class:`Generate`, :class:`Score` or
        :class:`Embed`, which write it to a temporary folder on the worker, load it, and
        remove the folder when the actor ends (at once when the model fails to load).

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        files = {}
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full):
                with open(full, "rb") as f:
                    files[name] = f.read()
        return {"name": os.path.basename(os.path.normpath(path)), "is_dir": True, "files": files}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"exactblocks.ray.pack_model: {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    name = os.path.basename(path)
    return {"name": name, "is_dir": False, "files": {name: data}}


def _unpack(packed: Mapping) -> tuple[str, str]:
    """Write a :func:`pack_model` dict to a new temporary folder: ``(model path, folder)``.

    The caller removes the folder (:func:`shutil.rmtree`) when the model is no longer used; on
    an error here it is removed before the error propagates.
    """
    root = tempfile.mkdtemp(prefix="exactblocks-ray-")
    try:
        folder = os.path.join(root, packed["name"]) if packed["is_dir"] else root
        os.makedirs(folder, exist_ok=True)
        for name, data in packed["files"].items():
            if os.path.basename(name) != name:
                raise ValueError(f"exactblocks.ray: packed file name {name!r} is not a plain name")
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return (folder if packed["is_dir"] else os.path.join(root, packed["name"])), root


def _assigned_cpus() -> int | None:
    """CPUs Ray assigned to this worker (an int >= 1), or None outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # not in a Ray worker, or an older Ray
        return None
    return None if not cpus else max(1, int(cpus))


class _Actor:
    """Shared ``__init__`` of the three callable classes (see :class:`Generate`)."""

    _name = "_Actor"

    def __init__(self, model=None, *, model_ref=None, num_threads=None, max_positions=None,
                 max_rows=16):  # fmt: skip
        import exactblocks

        where = f"exactblocks.ray.{self._name}"  # Ray Data wraps the class: not type(self)
        self._where = where
        if (model is None) == (model_ref is None):
            raise TypeError(
                f"{where}: give exactly one of model= (a path every node can see) and "
                "model_ref= (ray.put(exactblocks.ray.pack_model(path)))"
            )
        if model_ref is not None:
            packed = model_ref
            try:
                import ray

                if isinstance(model_ref, ray.ObjectRef):
                    packed = ray.get(model_ref)
            except ImportError:
                pass
            if not isinstance(packed, Mapping) or "files" not in packed:
                raise TypeError(
                    f"{where}: model_ref must hold exactblocks.ray.pack_model(path); got "
                    f"{type(packed).__name__}"
                )
            path, tmp_root = _unpack(packed)
            # The copy lives as long as this object (the model may read its file again, e.g.
            # a memory-mapped tensor), and no longer: every actor of every job would otherwise
            # leave a model-sized folder in the worker's temporary directory.
            self._tmp_cleanup = weakref.finalize(self, shutil.rmtree, tmp_root, True)
            shown = f"{path} (shipped as {packed['name']!r})"
        elif isinstance(model, exactblocks.Model):  # in-process use: already loaded
            path = shown = None
        elif isinstance(model, (str, os.PathLike)):
            path = shown = os.fspath(model)
        else:
            raise TypeError(
                f"{where}: model= must be a path (str or os.PathLike) or an exactblocks.Model; "
                f"got {type(model).__name__}"
            )
        if path is None:
            self.model, self.path = model, str(model.source)
        else:
            try:
                self.model = exactblocks.load_model(path, max_positions=max_positions)
            except Exception as exc:
                if model_ref is not None:
                    self._tmp_cleanup()
                raise ModelLoadError(
                    f"{where}: cannot load the model {shown!r}: {type(exc).__name__}: {exc}"
                ) from exc
            self.path = path
        if num_threads is None:
            num_threads = _assigned_cpus()
        if num_threads is not None:
            exactblocks.set_num_threads(int(num_threads))
        self.num_threads = exactblocks.get_num_threads()
        self.max_rows = _int_arg(max_rows, "max_rows", where, minimum=1)

    def _prompt_ids(self, row: Mapping, where_row: str) -> list[int]:
        """A row's prompt as ids: ``prompt`` (text) or ``messages`` (chat template)."""
        tok = self.model.tokenizer
        prompt, messages = row.get("prompt"), row.get("messages")
        if _is_null(prompt) and _is_null(messages):
            raise ValueError(f"{where_row}: the row has neither a 'prompt' nor 'messages'")
        if not _is_null(prompt) and not _is_null(messages):
            raise ValueError(f"{where_row}: the row has both a 'prompt' and 'messages'")
        if tok is None:
            raise TypeError(f"{where_row}: text rows need a tokenizer; this model has none")
        if not _is_null(prompt):
            if not isinstance(prompt, str):
                raise TypeError(f"{where_row}: prompt must be a str; got {type(prompt).__name__}")
            ids = list(tok.encode(prompt))
        else:
            msgs = _as_messages(messages, where_row)
            ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        if not ids:
            raise ValueError(f"{where_row}: the prompt is empty")
        return ids


# -- row helpers --------------------------------------------------------------------------------


def _is_null(v) -> bool:
    if v is None or v is _MISSING:
        return True
    return isinstance(v, float) and math.isnan(v)


def _int_arg(value, name, where, *, minimum=0, allow_none=False):
    """An int option; integral floats (an Arrow int column with nulls arrives as float) pass."""
    if _is_null(value):
        if allow_none:
            return None
        raise TypeError(f"{where}: {name} is missing")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: {name} must be an int; got bool")
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise TypeError(f"{where}: {name} must be an int; got {value!r}")
    elif not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {name} must be an int; got {type(value).__name__}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{where}: {name}={value} must be >= {minimum}")
    return value


def _as_messages(messages, where_row) -> list[dict]:
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"{where_row}: messages must be a list of {{'role', 'content'}} mappings; got "
            f"{type(messages).__name__}"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError(f"{where_row}: messages[{i}] is not a {{'role', 'content'}} mapping")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _rows(batch) -> tuple[dict[str, np.ndarray], list[dict]]:
    """A batch (dict of arrays or pandas DataFrame) -> its columns and one dict per row."""
    if hasattr(batch, "columns") and hasattr(batch, "iloc"):  # pandas.DataFrame
        cols = {str(c): batch[c].to_numpy() for c in batch.columns}
    elif isinstance(batch, Mapping):
        cols = {k: np.asarray(v) if not isinstance(v, np.ndarray) else v for k, v in batch.items()}
    else:
        raise TypeError(
            "exactblocks.ray: a batch must be a dict of arrays or a pandas DataFrame; got "
            f"{type(batch).__name__} (use batch_format='numpy' or 'pandas')"
        )
    for k, v in cols.items():  # Arrow lists arrive as ndarrays inside object columns: make
        if v.dtype == object and any(isinstance(e, np.ndarray) for e in v):  # them lists again,
            cols[k] = _object_array([e.tolist() if isinstance(e, np.ndarray) else e for e in v])
    # or Ray would store the kept column as pickled objects (unreadable by other tools)
    n = len(next(iter(cols.values()))) if cols else 0
    rows = [{k: (v[i].item() if isinstance(v[i], np.generic) else v[i]) for k, v in cols.items()}
            for i in range(n)]  # fmt: skip
    return cols, rows


def _object_array(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def token_logprobs(logits, targets) -> np.ndarray:
    """Log-probabilities of ``targets`` under ``logits``, the same bits on every CPU.

    :func:`exactblocks.sampling.token_logprobs` (the one logprob computation of the library,
    also behind ``Model.generate(logprobs=True)`` and the server): ``log_softmax(z)[t] =
    (z[t] - max z) - log1p(float32(S) - 1)`` with ``S = sum(exp(z - max z))``.

    Parameters
    ----------
    logits : array-like of shape (n, vocab_size), float32
    targets : array-like of shape (n,), int
        One token id per row of ``logits``.

    Returns
    -------
    ndarray of shape (n,), float32

    Raises
    ------
    ValueError
        Mismatched shapes.
    """
    from exactblocks.sampling import token_logprobs as _token_logprobs

    return _token_logprobs(logits, targets)


# -- Generate -----------------------------------------------------------------------------------


class Generate(_Actor):
    """Ray Data callable class: generate text for every row of a batch.

    Use as ``ds.map_batches(Generate, fn_constructor_kwargs={"model": PATH},
    compute=ray.data.ActorPoolStrategy(size=N), batch_size=..., num_cpus=...)``.

    Parameters
    ----------
    model : str, os.PathLike or exactblocks.Model, optional
        A path every node can see: a ``.gguf`` file, a ``save_pretrained`` folder or a
        ``.safetensors`` file (:func:`exactblocks.load_model`); or, in-process, a loaded
        ``Model`` (used as it is: no load, no Ray needed).
    model_ref : ray.ObjectRef or dict, optional
        Instead of ``model``: ``ray.put(pack_model(path))``, the model's bytes through the object
        store (written to a temporary folder on the worker, removed when this object is
        garbage-collected or its process exits).
    num_threads : int, optional
        Threads of this actor; default = the CPUs Ray assigned to it (``num_cpus``).
    max_positions : int, optional
        Passed to ``load_model``.
    max_rows : int, default=16
        Rows of a batch in flight at once (state slots); the other rows wait for a free slot.
    max_new_tokens : int, default=64
    temperature : float, default=0.0
    top_k : int, optional
    top_p : float, optional
    seed : int, default=0
        Defaults of the per-row columns of the same names (``Model.generate``). A row without a
        seed uses this one, so a sampled row never depends on OS entropy.
    stop : str, int or sequence (list or tuple) of int and str, optional
        Stop token ids and stop strings for every row, in addition to the model's
        ``eos_token_ids``; a str is one stop string.
    ignore_eos : bool, default=False
        True: the model's ``eos_token_ids`` do not stop a row.
    logprobs : bool, default=False
        Add the ``generated_logprobs`` column (:func:`token_logprobs` of each generated id).
    grammar : exactblocks.models.Grammar, optional
        Constrain every row's text (``Grammar.json_schema(schema)``, ``Grammar.lark(text)``;
        docs/generation.md); a row then also stops when the grammar is complete.

    Raises
    ------
    ModelLoadError
        The model cannot be loaded (the message names the path and the cause).
    TypeError
        Neither or both of ``model`` and ``model_ref``; ``model`` neither a path nor a Model;
        ``stop`` neither a str, an int nor a sequence of them.

    Notes
    -----
    Input columns: ``prompt`` (str) or ``messages`` (list of ``{"role", "content"}``, rendered
    with the tokenizer's chat template and the assistant opener); optional ``seed``,
    ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k`` (null = the default). Output:
    every input column plus ``generated_text`` (str), ``generated_ids`` (list of int64),
    ``num_generated_tokens`` (int64), ``finish_reason`` (``"length"`` or ``"stop"``;
    ``"error"``: a grammar's matcher failed mid-generation), ``generated_logprobs`` (list of
    float32, with ``logprobs=True``) and ``error`` (None, or why the row was refused or
    failed). A row's output equals
    ``load_model(PATH).generate(prompt_ids, ...)`` alone, bit for bit.
    """

    _name = "Generate"

    def __init__(self, model=None, *, model_ref=None, num_threads=None, max_positions=None,
                 max_rows=16, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None,
                 seed=0, stop=None, ignore_eos=False, logprobs=False, grammar=None):  # fmt: skip
        from exactblocks.models.generate import split_stop

        super().__init__(model, model_ref=model_ref, num_threads=num_threads,
                         max_positions=max_positions, max_rows=max_rows)  # fmt: skip
        self.defaults = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "seed": seed,
        }
        self.stop_ids, self.stop_strs = split_stop(stop, self._where)
        self.ignore_eos, self.logprobs, self.grammar = ignore_eos, logprobs, grammar
        self._params({}, [1], "Generate(...)")  # the defaults are checked once, here

    def _params(self, row, ids, where_row):
        """The row's SamplingParams (its columns over the defaults), checked by the core."""
        from exactblocks.models.generate import SamplingParams

        opt = {k: row.get(k) for k in self.defaults}
        opt = {k: self.defaults[k] if _is_null(v) else v for k, v in opt.items()}
        for k in ("max_new_tokens", "top_k", "seed"):  # an Arrow int column with nulls
            v = opt[k]  # arrives as float: integral floats are its ints
            if isinstance(v, float) and v.is_integer():
                opt[k] = int(v)
        if opt["seed"] is None:
            raise TypeError(f"{where_row}: seed is missing")
        params = SamplingParams.checked(
            where_row,
            {"max_tokens": "max_new_tokens"},
            max_tokens=opt["max_new_tokens"],
            temperature=opt["temperature"],
            top_k=opt["top_k"],
            top_p=opt["top_p"],
            seed=opt["seed"],
            stop=self.stop_strs,
            stop_token_ids=self.stop_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            grammar=self.grammar,
        )
        limit = self.model.max_positions
        if limit is not None and len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"{where_row}: the prompt ({len(ids)} tokens) plus max_new_tokens="
                f"{params.max_tokens} exceeds max_positions={limit}"
            )
        return self.model.generation(ids, params, where=where_row)

    def __call__(self, batch) -> dict[str, np.ndarray]:
        """Generate for every row of ``batch``; see the class Notes for the columns.

        Parameters
        ----------
        batch : dict of str to ndarray, or pandas.DataFrame

        Returns
        -------
        dict of str to ndarray
            The input columns and the output columns, one entry per row, in order.
        """
        from exactblocks.models.generate import run_batch

        cols, rows = _rows(batch)
        n = len(rows)
        errors: list[str | None] = [None] * n
        gens: dict = {}
        for i, row in enumerate(rows):
            where_row = f"{self._where}: row {i} of the batch"
            try:
                gens[i] = self._params(row, self._prompt_ids(row, where_row), where_row)
            except (TypeError, ValueError) as exc:
                errors[i] = str(exc)
        run_batch(self.model, list(gens.values()), max_rows=self.max_rows)
        for i, gen in gens.items():  # a grammar's matcher that failed mid-generation
            if gen.error is not None:
                errors[i] = f"{self._where}: row {i} of the batch: {gen.error}"
        out = dict(cols)
        out["generated_text"] = _object_array(
            [gens[i].text if i in gens else None for i in range(n)]
        )
        out["generated_ids"] = _object_array(
            [list(gens[i].ids) if i in gens else [] for i in range(n)]
        )
        out["num_generated_tokens"] = np.asarray(
            [len(gens[i].ids) if i in gens else 0 for i in range(n)], np.int64
        )
        out["finish_reason"] = _object_array(
            [gens[i].finish_reason if i in gens else None for i in range(n)]
        )
        if self.logprobs:
            out["generated_logprobs"] = _object_array(
                [list(gens[i].logprobs) if i in gens else [] for i in range(n)]
            )
        out["error"] = _object_array(errors)
        return out


# -- Score --------------------------------------------------------------------------------------


class Score(_Actor):
    """Ray Data callable class: log-probabilities of a given ``continuation`` after a prompt.

    Parameters
    ----------
    model, model_ref, num_threads, max_positions, max_rows
        As :class:`Generate` (``max_rows``: rows per forward call).

    Raises
    ------
    ModelLoadError, TypeError
        As :class:`Generate`.

    Notes
    -----
    Input columns: ``prompt`` (str) or ``messages`` (chat template with the assistant opener),
    and ``continuation`` (str, tokenised alone without special tokens and appended to the
    prompt's ids). Output: every input column plus ``continuation_ids`` (list of int64),
    ``continuation_logprobs`` (list of float32: ``log p(token | everything before it)``, see
    :func:`token_logprobs`), ``sum_logprob`` (float64, the exactly rounded sum of those
    float32 values) and ``error``.
    """

    _name = "Score"

    def __call__(self, batch) -> dict[str, np.ndarray]:
        """Score every row of ``batch``; see the class Notes for the columns.

        Parameters
        ----------
        batch : dict of str to ndarray, or pandas.DataFrame

        Returns
        -------
        dict of str to ndarray
        """
        cols, rows = _rows(batch)
        n = len(rows)
        errors: list[str | None] = [None] * n
        todo: dict[int, tuple[list[int], list[int]]] = {}
        for i, row in enumerate(rows):
            where_row = f"{self._where}: row {i} of the batch"
            try:
                p_ids = self._prompt_ids(row, where_row)
                cont = row.get("continuation")
                if not isinstance(cont, str):
                    raise TypeError(
                        f"{where_row}: continuation must be a str; got {type(cont).__name__}"
                    )
                c_ids = list(self.model.tokenizer.encode(cont, add_special_tokens=False))
                if not c_ids:
                    raise ValueError(f"{where_row}: the continuation is empty")
                limit = self.model.max_positions
                if limit is not None and len(p_ids) + len(c_ids) > limit:
                    raise ValueError(
                        f"{where_row}: prompt + continuation = {len(p_ids) + len(c_ids)} "
                        f"tokens exceeds max_positions={limit}"
                    )
                todo[i] = (p_ids, c_ids)
            except (TypeError, ValueError) as exc:
                errors[i] = str(exc)
        logps: dict[int, np.ndarray] = {}
        order = list(todo)
        for start in range(0, len(order), self.max_rows):
            chunk = order[start : start + self.max_rows]
            seqs = [todo[i][0] + todo[i][1] for i in chunk]
            lens = np.asarray([len(s) for s in seqs], np.int64)
            ids = np.zeros((len(seqs), int(lens.max())), np.int64)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = s
            x = self.model.hidden_states(ids, lengths=lens, layer=-1)
            for r, i in enumerate(chunk):
                p_len, c_ids = len(todo[i][0]), todo[i][1]
                logits = self.model.logits(x[r, p_len - 1 : p_len - 1 + len(c_ids)])
                logps[i] = token_logprobs(logits, np.asarray(c_ids))
        out = dict(cols)
        out["continuation_ids"] = _object_array(
            [list(todo[i][1]) if i in todo else [] for i in range(n)]
        )
        out["continuation_logprobs"] = _object_array(
            [list(logps[i]) if i in logps else [] for i in range(n)]  # np.float32 items
        )
        out["sum_logprob"] = np.asarray(
            [math.fsum(logps[i].tolist()) if i in logps else math.nan for i in range(n)],
            np.float64,
        )
        out["error"] = _object_array(errors)
        return out


# -- Embed --------------------------------------------------------------------------------------


class Embed(_Actor):
    """Ray Data callable class: one float32 vector per row, a pooled hidden state.

    Parameters
    ----------
    model, model_ref, num_threads, max_positions, max_rows
        As :class:`Generate` (``max_rows``: rows per forward call).
    layer : int or None, default=None
        None: the final hidden state after the model's final norm (what the output head
        reads). An int: the output of block ``layer`` (0-based; negative counts from the end,
        -1 = the last block before the final norm).
    pooling : {"last", "mean"}, default="last"
        The last prompt position, or the mean over the prompt's positions (summed in float64
        in position order, divided, rounded to float32).

    Raises
    ------
    ModelLoadError, TypeError
        As :class:`Generate`.
    ValueError
        ``layer`` outside the model's blocks or an unknown ``pooling``.

    Notes
    -----
    Input columns: ``prompt`` (str) or ``messages`` (chat template with the assistant
    opener). Output: every input column plus ``embedding`` (float32, shape (d_model,) per row;
    NaN on a refused row) and ``error``.
    """

    _name = "Embed"

    def __init__(self, model=None, *, model_ref=None, num_threads=None, max_positions=None,
                 max_rows=16, layer=None, pooling="last"):  # fmt: skip
        super().__init__(model, model_ref=model_ref, num_threads=num_threads,
                         max_positions=max_positions, max_rows=max_rows)  # fmt: skip
        if pooling not in ("last", "mean"):
            raise ValueError(f"{self._where}: pooling={pooling!r}; expected 'last' or 'mean'")
        self.pooling = pooling
        n_layers = len(self.model.blocks)
        if layer is None:
            self.layer = None
        else:
            layer = _int_arg(layer, "layer", self._where, minimum=-n_layers)
            if layer >= n_layers:
                raise ValueError(f"{self._where}: layer={layer}; the model has {n_layers} blocks")
            self.layer = layer % n_layers

    def __call__(self, batch) -> dict[str, np.ndarray]:
        """Embed every row of ``batch``; see the class Notes for the columns.

        Parameters
        ----------
        batch : dict of str to ndarray, or pandas.DataFrame

        Returns
        -------
        dict of str to ndarray
            ``embedding`` is a (batch, d_model) float32 array.
        """
        cols, rows = _rows(batch)
        n, d = len(rows), self.model.d_model
        errors: list[str | None] = [None] * n
        todo: dict[int, list[int]] = {}
        limit = self.model.max_positions
        for i, row in enumerate(rows):
            where_row = f"{self._where}: row {i} of the batch"
            try:
                ids = self._prompt_ids(row, where_row)
                if limit is not None and len(ids) > limit:
                    raise ValueError(
                        f"{where_row}: the prompt ({len(ids)} tokens) exceeds max_positions={limit}"
                    )
                todo[i] = ids
            except (TypeError, ValueError) as exc:
                errors[i] = str(exc)
        emb = np.full((n, d), np.nan, np.float32)
        order = list(todo)
        for start in range(0, len(order), self.max_rows):
            chunk = order[start : start + self.max_rows]
            lens = np.asarray([len(todo[i]) for i in chunk], np.int64)
            ids = np.zeros((len(chunk), int(lens.max())), np.int64)
            for r, i in enumerate(chunk):
                ids[r, : lens[r]] = todo[i]
            x = self.model.hidden_states(ids, lengths=lens, layer=self.layer)
            for r, i in enumerate(chunk):
                h = x[r, : lens[r]]
                if self.pooling == "last":
                    emb[i] = h[-1]
                else:
                    acc = np.zeros(d, np.float64)
                    for t in range(h.shape[0]):  # position order: the same sum everywhere
                        acc += h[t]
                    emb[i] = (acc / h.shape[0]).astype(np.float32)
        out = dict(cols)
        out["embedding"] = emb
        out["error"] = _object_array(errors)
        return out
