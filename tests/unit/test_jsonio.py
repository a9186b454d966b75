"""The manifest's JSON writer: `dumps_indented` is `json.dumps(data, indent=1)` byte for byte (the manifest's
bytes, hence its checksum-free layout and every tool that diffs manifests, stay as they were), several times
faster, and hands anything it does not write itself to the json module."""

from __future__ import annotations

import enum
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preshard.format.jsonio import dumps_indented

_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text()
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(data=_JSON)
def test_it_writes_what_json_writes(data):
    assert dumps_indented(data) == json.dumps(data, indent=1)


class _Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "data",
    [{}, [], {"a": []}, [{}], (1, (2, 3)), {"k": (1,)}, [math.inf, -math.inf, -0.0, 1e300], {1: "int key"},
     {"e": _Color.RED}, "é\n\"\\\u2028", {"a": {"b": {"c": [None, True, False]}}}],
)  # fmt: skip
def test_edge_cases_and_what_it_leaves_to_json(data):
    assert dumps_indented(data) == json.dumps(data, indent=1)


def test_what_json_refuses_is_refused():
    with pytest.raises(TypeError):
        dumps_indented({"a": object()})
