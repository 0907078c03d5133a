"""Bad inputs fail as PyG's layers fail, and no cache returns a graph its tensors no longer hold."""

from __future__ import annotations

import pytest
import torch
import torch_geometric.nn as pygnn

import dsx.rgnn as rg
from tests.rgnn.test_layers import rel_graph

LAYERS = {
    "rgcn": (lambda: rg.RGCNConv(7, 6, 5), lambda: pygnn.RGCNConv(7, 6, 5)),
    "rgat": (lambda: rg.RGATConv(7, 6, 5), lambda: pygnn.RGATConv(7, 6, 5)),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize(
    ("which", "dtype"),
    [("edge_index", torch.int16), ("edge_index", torch.uint8), ("edge_type", torch.bool),
     ("edge_type", torch.uint8), ("edge_type", torch.int8)],
)  # fmt: skip
def test_index_dtypes_pyg_refuses_are_refused(layer, which, dtype) -> None:
    ei, et = rel_graph()
    args = {"edge_index": ei, "edge_type": et % 2 if dtype == torch.bool else et}
    args[which] = args[which].to(dtype)
    x = torch.randn(23, 7)
    ours, theirs = (make() for make in LAYERS[layer])
    with pytest.raises(RuntimeError):  # PyG refuses them too (its scatter / index_select do)
        theirs(x, args["edge_index"], args["edge_type"])
    with pytest.raises(TypeError, match=rf"{which} must be an int32 or int64 tensor .*got {dtype}"):
        ours(x, args["edge_index"], args["edge_type"])


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_missing_edge_type_is_a_clear_error(layer) -> None:
    ei, _ = rel_graph()
    with pytest.raises(TypeError, match="edge_type is required"):
        LAYERS[layer][0]()(torch.randn(23, 7), ei, None)


@pytest.mark.parametrize(("row", "name"), [(0, "source"), (1, "destination")])
def test_a_node_index_equal_to_the_node_count_is_out_of_range(row, name) -> None:
    ei, et = rel_graph()
    ei[row, 3] = 23  # one past the last node: must be refused, not read past the table
    with pytest.raises(ValueError, match=rf"{name} node indices span \[\d+, 23\] but there are 23"):
        rg.RGCNConv(7, 6, 5)(torch.randn(23, 7), ei, et)
    et[0] = 5
    with pytest.raises(ValueError, match=r"edge_type values span \[0, 5\] but num_relations=5"):
        rg.prepare(ei.clamp(max=22), et, 23, 5)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_an_inference_graph_refilled_in_place_is_not_served_from_the_cache(layer) -> None:
    torch.manual_seed(0)
    ours, theirs = (make() for make in LAYERS[layer])
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(23, 7)
    rg.clear_cache()
    with torch.inference_mode():
        ei, et = (t.clone() for t in rel_graph(seed=1))
        torch.testing.assert_close(ours(x, ei, et), theirs(x, ei, et), atol=2e-5, rtol=1e-4)
        new_ei, new_et = rel_graph(seed=2)
        ei.copy_(new_ei)
        et.copy_(new_et)
        torch.testing.assert_close(ours(x, ei, et), theirs(x, ei, et), atol=2e-5, rtol=1e-4)


def test_hgt_inference_edges_refilled_in_place_give_the_new_graph() -> None:
    torch.manual_seed(0)
    meta = (["a", "b"], [("a", "to", "b"), ("b", "to", "a")])
    theirs = pygnn.HGTConv(8, 8, meta, heads=2)
    ours = rg.HGTConv(8, 8, meta, heads=2)
    ours.load_state_dict(theirs.state_dict())
    x = {"a": torch.randn(9, 8), "b": torch.randn(7, 8)}
    gen = torch.Generator().manual_seed(3)

    def edges() -> dict:
        return {("a", "to", "b"): torch.stack([torch.randint(0, 9, (20,), generator=gen),
                                               torch.randint(0, 7, (20,), generator=gen)]),
                ("b", "to", "a"): torch.stack([torch.randint(0, 7, (15,), generator=gen),
                                               torch.randint(0, 9, (15,), generator=gen)])}  # fmt: skip

    with torch.inference_mode():
        ei = {k: v.clone() for k, v in edges().items()}
        first = ours(x, ei)
        for k, v in edges().items():
            ei[k].copy_(v)
        got, want = ours(x, ei), theirs(x, ei)
        for t in want:
            torch.testing.assert_close(got[t], want[t], atol=2e-5, rtol=1e-4)
        assert not torch.allclose(got["b"], first["b"])  # the refill really changed the graph
