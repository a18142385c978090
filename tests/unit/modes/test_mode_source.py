"""A mode's source: the module walk of the last push is reused only while the tree is the
same object for object, and parameters are read as the model holds them now."""

from __future__ import annotations

import torch
from torch import nn

from weightsync.modes import make_mode
from weightsync.modes.base import tree_fingerprint


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def read(source: object) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in source.tensors()}  # type: ignore[attr-defined]


def test_the_walk_is_reused_while_the_tree_is_the_same() -> None:
    m, mode = model(), make_mode("full")
    first = mode.source(m)
    with torch.no_grad():
        m[0].weight.add_(1.0)  # values change every step: the walk stays valid
    again = mode.source(m)
    assert again._names is first._names  # type: ignore[attr-defined]
    assert torch.equal(read(again)["0.weight"], m[0].weight)


def test_the_mode_does_not_keep_a_dropped_model_alive() -> None:
    import gc
    import weakref

    m, mode = model(), make_mode("full")
    mode.source(m)
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_a_changed_tree_is_walked_again_and_read_as_it_is_now() -> None:
    m, mode = model(), make_mode("full")
    first = mode.source(m)
    m[2] = nn.Linear(6, 3)  # a submodule replaced: new parameters under the same names
    second = mode.source(m)
    assert second._names is not first._names  # type: ignore[attr-defined]
    assert torch.equal(read(second)["2.weight"], m[2].weight)
    m[0].weight = nn.Parameter(torch.zeros(6, 4))  # a parameter replaced in place
    third = mode.source(m)
    assert third._names is not second._names  # type: ignore[attr-defined]
    assert torch.equal(read(third)["0.weight"], torch.zeros(6, 4))
    m[2].weight = m[0].weight  # tied now (shapes aside): one name fewer
    assert len(list(mode.source(m).tensors())) == 3
    other = model()
    assert mode.source(other).model is other  # type: ignore[attr-defined]


def test_fingerprints_differ_by_type_names_and_identity() -> None:
    m = model()
    base = tree_fingerprint(m)
    assert tree_fingerprint(m) == base
    other = model()
    other.load_state_dict(m.state_dict())
    assert tree_fingerprint(other) != base  # equal values, other objects
    m.add_module("extra", nn.Identity())
    assert tree_fingerprint(m) != base
    renamed = nn.Sequential()
    for name, child in model().named_children():
        renamed.add_module(f"layer{name}", child)
    assert tree_fingerprint(renamed) != tree_fingerprint(nn.Sequential(*renamed.children()))


def test_a_source_reads_parameters_swapped_behind_its_back() -> None:
    """FSDP2 swaps a module's registered parameters (sharded, unsharded) around forward
    passes: the source reads the module's dicts when it reads, not when it was made."""
    m = model()
    source = make_mode("full").source(m)
    swapped = nn.Parameter(torch.full((3, 6), 2.0))
    m[2]._parameters["weight"] = swapped
    assert read(source)["2.weight"].eq(2.0).all()
    assert source.param("2.weight") is swapped  # type: ignore[attr-defined]


def test_fingerprints_record_empty_slots_and_where_names_end() -> None:
    """An empty child slot and a parameter set to None are part of the tree; a name moved
    from parameters to children is another tree."""
    m = model()
    base = tree_fingerprint(m)
    m.register_module("gap", None)
    with_gap = tree_fingerprint(m)
    assert with_gap != base
    m[0].register_parameter("bias", None)
    assert tree_fingerprint(m) != with_gap
    a, b = nn.Module(), nn.Module()
    a.register_parameter("w", nn.Parameter(torch.zeros(1)))
    b.add_module("w", nn.Identity())
    assert tree_fingerprint(a)[2:] != tree_fingerprint(b)[2:]


def test_metas_follow_a_dtype_change_in_place() -> None:
    """`model.to(dtype)` keeps the Parameter objects (same tree, same walk) and changes what
    they hold: the reused source reports the new dtype and shape."""
    m, mode = model(), make_mode("full")
    assert {meta.dtype for meta in mode.source(m).metas()} == {torch.float32}
    m.to(torch.bfloat16)
    metas = mode.source(m).metas()
    assert {meta.dtype for meta in metas} == {torch.bfloat16}
    assert [meta.shape for meta in metas] == [(6, 4), (6,), (3, 6), (3,)]
