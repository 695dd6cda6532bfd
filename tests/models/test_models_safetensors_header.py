"""safetensors headers that lie are refused, naming the file and the tensor.

Each file is written byte by byte here (8-byte length, JSON header, data), so a header can say
what no writer would: a shape with a float or a negative dimension (before, ``int()`` truncated
``2.5`` to 2 and the file loaded), offsets that are not integers, and two tensors whose bytes
overlap (before, both were read from the same bytes).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from exactblocks.loaders.safetensors import SafetensorsSource, read_header


def write(path, header: dict, data: bytes) -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)
    return str(path)


DATA = np.arange(8, dtype=np.float32).tobytes()  # 32 bytes


def test_a_well_formed_header_reads(tmp_path):
    path = write(
        tmp_path / "ok.safetensors",
        {
            "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
            "empty": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
            "__metadata__": {"format": "pt"},
        },
        DATA,
    )
    tensors, _ = read_header(path)
    assert tensors["a"]["shape"] == (2, 2) and tensors["empty"]["shape"] == (0,)
    src = SafetensorsSource([path])
    assert np.array_equal(src["b"], np.arange(4, 8, dtype=np.float32))


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        ({"shape": [2.5, 2]}, r"tensor 'a' has shape \[2\.5, 2\]; expected a list of non-negative"),
        ({"shape": [4.0]}, r"has shape \[4\.0\]; expected a list of non-negative integers"),
        ({"shape": [-4]}, r"has shape \[-4\]"),
        ({"shape": ["4"]}, r"has shape \['4'\]"),
        ({"shape": [True, 4]}, r"has shape \[True, 4\]"),
        ({"shape": 4}, r"has shape 4;"),
        ({"data_offsets": [0.0, 16]}, r"has data_offsets \[0\.0, 16\]; expected two non-negative"),
        ({"data_offsets": [-16, 0]}, r"has data_offsets \[-16, 0\]"),
    ],
)
def test_non_integer_shapes_and_offsets_are_refused(tmp_path, entry, pattern):
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], **entry}}
    path = write(tmp_path / "bad.safetensors", header, DATA)
    with pytest.raises(ValueError, match=re.escape(repr(path)) + ".*" + pattern):
        read_header(path)


def test_overlapping_tensor_data_is_refused(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    path = write(tmp_path / "overlap.safetensors", header, DATA)
    with pytest.raises(ValueError, match=r"the data of tensors 'a' and 'b' overlap \(bytes"):
        SafetensorsSource([path])
    same = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    }
    path = write(tmp_path / "alias.safetensors", same, DATA)
    with pytest.raises(ValueError, match="overlap"):
        read_header(path)


@pytest.mark.parametrize("metadata", [5, "pt", [["format", "pt"]], {"format": 5}, {"a": None}])
def test_metadata_that_is_not_a_map_of_strings_is_refused(tmp_path, metadata):
    """The format's ``__metadata__`` is a str -> str map; the safetensors library refuses any
    other (the oracle, when installed), and so does the reader."""
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    path = write(tmp_path / "meta.safetensors", {**header, "__metadata__": metadata}, DATA[:16])
    shown = re.escape(repr(metadata))
    with pytest.raises(ValueError, match=re.escape(repr(path)) + f": __metadata__={shown} is not"):
        read_header(path)
    try:
        from safetensors import safe_open
    except ImportError:
        return
    with pytest.raises(Exception):  # noqa: B017, PT011 (the library's own error type)
        with safe_open(path, "np"):
            pass
    ok = write(tmp_path / "ok.safetensors", {**header, "__metadata__": {"format": "pt"}}, DATA[:16])
    with safe_open(ok, "np") as f:  # (the library does read the well-formed one)
        assert f.metadata() == {"format": "pt"}
