"""The strict safetensors header reader: every random or damaged header is a one-line SourceError or a
header whose tensors exactly tile the file; bools in shapes and non-string metadata are refused, as the
safetensors library refuses them."""

from __future__ import annotations

import json
import struct
from datetime import timedelta
from pathlib import Path

import pytest
from fuzz import JSON_VALUES, json_paths, mutated
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from preshard.errors import PreshardError, SourceError
from preshard.format.dtypes import SAFETENSORS_DTYPES as DTYPES
from preshard.sources.safetensors_file import read_header


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _valid_safetensors_bytes() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "b": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]},
        "s": {"dtype": "I64", "shape": [], "data_offsets": [24, 32]},
    }
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(range(32))


VALID_ST = _valid_safetensors_bytes()
VALID_ST_HEADER = json.loads(VALID_ST[8 : 8 + struct.unpack("<Q", VALID_ST[:8])[0]])

RANDOM_ENTRY = st.one_of(
    st.fixed_dictionaries(
        {
            "dtype": st.one_of(st.sampled_from(sorted(DTYPES)), JSON_VALUES),
            "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), JSON_VALUES),
            "data_offsets": st.one_of(st.lists(st.integers(-4, 200), max_size=3), JSON_VALUES),
        }
    ),
    JSON_VALUES,
)


@st.composite
def _safetensors_files(draw) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated-json", "mutated-bytes", "truncated"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "truncated":
        return VALID_ST[: draw(st.integers(0, len(VALID_ST) - 1))]
    if kind == "mutated-bytes":
        data = bytearray(VALID_ST)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "json":
        header = draw(st.dictionaries(st.text(max_size=6) | st.just("__metadata__"), RANDOM_ENTRY, max_size=4))
    else:
        header = draw(mutated(VALID_ST_HEADER, list(json_paths(VALID_ST_HEADER))))
    raw = json.dumps(header).encode()
    length = draw(st.one_of(st.just(len(raw)), st.integers(0, 2**64 - 1)))
    return struct.pack("<Q", length) + raw + draw(st.binary(max_size=120))


@pytest.mark.timeout(120)
@settings(max_examples=200, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
@given(data=_safetensors_files())
def test_fuzz_safetensors_headers_only_raise_preshard_error(fuzz_dir, data):
    path = fuzz_dir / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        header = read_header(path)
    except PreshardError:
        return
    assert sum(t.nbytes for t in header.tensors.values()) == header.size - header.header_bytes


def _write(folder: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path = folder / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.mark.parametrize(
    "header, needle",
    [
        ({"w": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}}, "invalid shape"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {"a": 1}}, "__metadata__"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}}, "invalid data_offsets"),
    ],
)
def test_what_the_safetensors_library_rejects_is_refused(tmp_path, header, needle):
    with pytest.raises(SourceError, match=needle):
        read_header(_write(tmp_path, header, b"\0" * 8))
