"""Read a captured CUDA graph back: its kernel nodes, its edges and their types.

A launch with programmatic stream serialization (PDL) becomes a programmatic edge
(CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, type 1) into the kernel node it launched; the
fork of the side stream shows as a graph with two roots (or a node with two
successors) and the join as a node with two predecessors. Capture with
DecodeStep.capture(keep_graph=True) so the cudaGraph_t is still there to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cuda.bindings import driver as cu

PROGRAMMATIC = 1


def _ok(result):
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


@dataclass
class Node:
    """One node of a captured graph."""

    index: int
    kind: str  # "kernel", "memcpy", "memset", "event_record", ...
    name: str  # kernel function name, "" for other nodes


@dataclass
class Edge:
    """One dependency of a captured graph, with its type (programmatic edges come from PDL)."""

    src: int
    dst: int
    type: int  # 0 default, 1 programmatic
    from_port: int


@dataclass
class GraphInfo:
    """A captured graph's nodes and edges, with the queries the step's graph tests ask."""

    nodes: list[Node]
    edges: list[Edge] = field(default_factory=list)

    def successors(self, index: int) -> list[int]:
        """The nodes that depend on node `index`."""
        return [e.dst for e in self.edges if e.src == index]

    def predecessors(self, index: int) -> list[int]:
        """The nodes node `index` depends on."""
        return [e.src for e in self.edges if e.dst == index]

    @property
    def roots(self) -> list[int]:
        """Nodes with no dependency: where the graph's streams start."""
        return [n.index for n in self.nodes if not self.predecessors(n.index)]

    @property
    def forks(self) -> list[int]:
        """Nodes with more than one dependent: where the side stream forks."""
        return [n.index for n in self.nodes if len(self.successors(n.index)) > 1]

    @property
    def joins(self) -> list[int]:
        """Nodes with more than one dependency: where the streams join."""
        return [n.index for n in self.nodes if len(self.predecessors(n.index)) > 1]

    @property
    def programmatic(self) -> list[Edge]:
        """The programmatic (PDL) edges."""
        return [e for e in self.edges if e.type == PROGRAMMATIC]

    def kernels(self, contains: str = "") -> list[Node]:
        """Kernel nodes whose name contains `contains`."""
        return [n for n in self.nodes if n.kind == "kernel" and contains in n.name]


def kernel_name(node) -> str:
    """A kernel node's function name, as the driver gives it (a placeholder if it cannot)."""
    try:
        params = _ok(cu.cuGraphKernelNodeGetParams(node))
        name = _ok(cu.cuFuncGetName(params.func))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception as error:  # a node whose function the driver cannot name
        return f"<unnamed: {error}>"


def short(name: str, width: int = 48) -> str:
    """A readable kernel name: CuTe DSL's mangled names start with kernel_cutlass_<method>_,
    the method named after the kernel's stage (cute:<stage>)."""
    if name.startswith("kernel_cutlass_"):
        name = "cute:" + name.removeprefix("kernel_cutlass_").split("_graphstep")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def inspect(graph) -> GraphInfo:
    """Nodes and edges of a torch.cuda.CUDAGraph captured with keep_graph=True."""
    handle = cu.CUgraph(graph.raw_cuda_graph())
    _, count = _ok(cu.cuGraphGetNodes(handle, 0))
    raw_nodes, _ = _ok(cu.cuGraphGetNodes(handle, count))
    index = {int(n): i for i, n in enumerate(raw_nodes)}
    nodes = []
    for i, node in enumerate(raw_nodes):
        kind = _ok(cu.cuGraphNodeGetType(node))
        label = kind.name.removeprefix("CU_GRAPH_NODE_TYPE_").lower()
        nodes.append(Node(i, label, kernel_name(node) if label == "kernel" else ""))
    _, _, _, n_edges = _ok(cu.cuGraphGetEdges(handle, 0))
    src, dst, data, _ = _ok(cu.cuGraphGetEdges(handle, n_edges))
    edges = [Edge(index[int(a)], index[int(b)], int(d.type), int(d.from_port)) for a, b, d in zip(src, dst, data)]
    return GraphInfo(nodes, edges)
