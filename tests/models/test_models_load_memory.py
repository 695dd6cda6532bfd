"""Loading a GGUF lean: what ``load_model`` and a greedy ``generate`` of SmolLM2-135M do not do
(import ``gguf`` or ``numpy.random``, compute fingerprints, keep per-layer copies), that the
file is left as it was, and that a truncated or foreign GGUF still gets a clear error.

The memory figures themselves are measured by ``python -m benchmarks.load``, not
asserted here: they depend on the machine and the library versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import exactblocks


@pytest.fixture(scope="module")
def smollm2_path():
    from exactblocks.loaders.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


_CHILD = """
import json, sys
import exactblocks
model = exactblocks.load_model(sys.argv[1])
out = model.generate("The capital of France is", max_new_tokens=3)
print(json.dumps({
    "gguf": "gguf" in sys.modules,
    "numpy.random": "numpy.random" in sys.modules,
    "model_fp": model._fingerprint._value,
    "block_fp": [b._impl.fp._value for b in model.blocks],
    "ids": out.ids,
}))
"""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def test_greedy_generate_from_gguf_imports_and_hashes_nothing_extra(smollm2_path):
    """A fresh process: load + greedy generate import neither gguf (sentencepiece, yaml: ~5 MB)
    nor numpy.random (libcrypto), and compute no fingerprint; the tokens are those of a model
    whose fingerprints are read, and the file is unchanged (its pages were only dropped)."""
    before = _sha256(smollm2_path)
    src = os.path.dirname(os.path.dirname(exactblocks.__file__))  # the exactblocks under test
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, smollm2_path],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["gguf"] is False and got["numpy.random"] is False, got
    assert got["model_fp"] is None and got["block_fp"] == [None] * 30, got
    model = exactblocks.load_model(smollm2_path)
    fp = model.fingerprint  # computed now: the same model, the same tokens
    assert len(fp) == 32 and all(len(b.fingerprint) == 32 for b in model.blocks)
    assert model.generate("The capital of France is", max_new_tokens=3).ids == got["ids"]
    assert _sha256(smollm2_path) == before


def test_model_state_checks_by_identity_then_by_value(smollm2_path):
    """A model's states carry its fingerprint object; a second load of the same file is
    another object with the same digest, so it accepts the first model's states (and gives
    the same bits from them), while a pickled state carries the string."""
    import pickle

    a = exactblocks.load_model(smollm2_path)
    b = exactblocks.load_model(smollm2_path)
    ids = np.array([[1, 2, 3, 4]])
    st = a.allocate_state(1, 8)
    a.forward(ids, st)
    assert a._fingerprint._value is None
    twin = pickle.loads(pickle.dumps(st))
    assert a._fingerprint._value is not None  # pickling asked for the string
    la = a.step([5], st)
    lb = b.step([5], twin)  # b's digest is computed and compared: equal
    assert np.array_equal(la.view(np.uint32), lb.view(np.uint32))
    assert twin.fingerprint == st.fingerprint == a.fingerprint == b.fingerprint


def test_array_source_forgets_built_layers():
    from exactblocks.loaders.torch import ArraySource

    w = np.ones((3, 2), np.float32)
    src = ArraySource({"a": w, "b": w}, "here")
    assert src.same_storage("a", "b")
    src.forget(["a", "missing"])
    assert src.shape("a") == (3, 2) and "a" in src and len(src) == 2
    with pytest.raises(KeyError, match="'a' was forgotten"):
        src["a"]
    assert src["b"] is w and not src.same_storage("a", "b")


def _truncated(src: str, dst, n: int) -> str:
    with open(src, "rb") as f:
        dst.write_bytes(f.read(n))
    return str(dst)


def test_truncated_and_foreign_gguf_files_get_clear_errors(smollm2_path, tmp_path):
    from exactblocks.loaders.gguf import GGUFFile

    header = GGUFFile(smollm2_path)
    first = min(int(t.data.ctypes.data - header.data.ctypes.data) for t in header.tensors)
    del header
    cases = [
        (1 << 20, r"is truncated \(header past the end\)"),  # inside the vocabulary
        (first + 4096, r"is truncated: tensor '.*' needs bytes \["),  # inside the weights
    ]
    for n, match in cases:
        path = _truncated(smollm2_path, tmp_path / f"cut{n}.gguf", n)
        with pytest.raises(ValueError, match=f"cannot read {path!r} as a GGUF model: .*{match}"):
            exactblocks.load_model(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        exactblocks.load_model(str(bad))
    bad.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1; 2 or 3 is read"):
        exactblocks.load_model(str(bad))
    # one metadata field of an unknown value type (code 99)
    key = b"general.x"
    body = (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little")
    body += len(key).to_bytes(8, "little") + key + (99).to_bytes(4, "little")
    bad.write_bytes(b"GGUF" + body)
    with pytest.raises(ValueError, match="field 'general.x' has unknown value type 99"):
        exactblocks.load_model(str(bad))


def test_lean_reader_tables_equal_gguf_py():
    """GGUFFile's own copies of the format's type codes (so that it need not import gguf) are
    gguf-py's: value types and their struct formats, tensor block sizes."""
    import struct

    gguf = pytest.importorskip("gguf")
    from exactblocks.loaders.gguf import reader as lean

    vt = gguf.GGUFValueType
    assert (lean._GGUF_STRING, lean._GGUF_ARRAY, lean._GGUF_BOOL) == (
        int(vt.STRING),
        int(vt.ARRAY),
        int(vt.BOOL),
    )
    widths = {"UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "UINT32": 4, "INT32": 4,
              "FLOAT32": 4, "BOOL": 1, "UINT64": 8, "INT64": 8, "FLOAT64": 8}  # fmt: skip
    assert sorted(lean._GGUF_SCALARS) == sorted(int(getattr(vt, n)) for n in widths)
    for name, width in widths.items():
        fmt = lean._GGUF_SCALARS[int(getattr(vt, name))]
        assert struct.calcsize(fmt) == width, name
        if name.startswith("FLOAT") or name == "BOOL":
            assert fmt[-1] in "fd?", name
        else:  # struct: upper case = unsigned
            assert fmt[-1].isupper() == name.startswith("U"), name
    for code, sizes in lean._GGML_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(code)] == sizes, code
    assert (lean._GGML_F32, lean._GGML_F16) == (
        int(gguf.GGMLQuantizationType.F32),
        int(gguf.GGMLQuantizationType.F16),
    )


def test_tokenizer_vocabulary_fast_path_and_respelling():
    """GGUFTokenizer maps a vocabulary spelled in GPT-2's byte alphabet as it is (one dict
    build), and re-spells a token written otherwise byte by byte (here '€', UTF-8 e2 82 ac,
    whose byte-alphabet spelling is 'âĤ¬': 0x82 is not printable, GPT-2 maps it
    to U+0124); a merge that is not two tokens is named."""
    pytest.importorskip("tokenizers")
    from exactblocks.text import GGUFTokenizer

    plain = GGUFTokenizer(["a", "b", "ab", "Ġa"], ["a b"])
    assert plain._tok.get_vocab() == {"a": 0, "b": 1, "ab": 2, "Ġa": 3}
    assert plain.encode("ab") == [2]
    mixed = GGUFTokenizer(["a", "b", "ab", "€"], ["a b"])
    assert mixed._tok.get_vocab() == {"a": 0, "b": 1, "ab": 2, "âĤ¬": 3}
    assert mixed.decode([3, 2]) == "€ab"
    with pytest.raises(ValueError, match=r"merges\[1\]='a b ab' is not two tokens"):
        GGUFTokenizer(["a", "b", "ab"], ["a b", "a b ab"])
