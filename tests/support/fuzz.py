"""Hypothesis strategies for hostile JSON: random values, and valid documents with a few random edits."""

from __future__ import annotations

import copy

from hypothesis import strategies as st

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**66), 2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from([0, -1, 1, 2, 3, 2**63, "", "bfloat16", "float16", "float32", "colwise", "rowwise", "__0_0.distcp",
                     "__1_0.distcp", "../x", "replicate", "packed_colwise", "F32"]),
)  # fmt: skip
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def json_paths(value, prefix=()):
    """Every path (tuple of keys and indices) into a JSON document."""
    if prefix:
        yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from json_paths(item, (*prefix, i))


def perturbed(value):
    """A value of the same JSON type (so that it gets past the type checks and into the consistency checks)."""
    if isinstance(value, bool) or value is None:
        return st.one_of(st.booleans(), st.none(), st.integers(-2, 3))
    if isinstance(value, int):
        return st.one_of(st.integers(-3, 3), st.integers(value - 2, value + 2), st.integers(0, 2**40), st.just(2**63))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=8), st.sampled_from(["bfloat16", "float16", "colwise", "__1_0.distcp"]))
    if isinstance(value, list):
        return st.one_of(st.just(value[:-1]), st.just(value + value[-1:]), st.just(value[::-1]))
    return JSON_VALUES


@st.composite
def mutated(draw, base, paths):
    """`base` with 1-3 random edits at random paths: a key dropped, a value replaced, or perturbed in type."""
    data = copy.deepcopy(base)
    shallow = [p for p in paths if len(p) <= 2]
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(shallow) if draw(st.integers(0, 3)) == 0 else st.sampled_from(paths))
        parent = data
        try:
            for key in path[:-1]:
                parent = parent[key]
            current = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):  # an earlier edit left a string here: indexable, not editable
            continue
        op = draw(st.sampled_from(["drop", "replace", "perturb", "perturb"]))
        if op == "drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES if op == "replace" else perturbed(current))
    return data
