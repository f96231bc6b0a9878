"""Model graphdefs as static jit arguments, and the merge that rebuilds the models inside a program."""

from __future__ import annotations

from flax import nnx


class StaticGraph:
    """A model graphdef as a static jit argument, hashed once: jit hashes its static arguments on
    every call, and a graphdef's own hash walks the whole module graph."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (other.graphdef is self.graphdef or other.graphdef == self.graphdef)


def _graph(g):
    return g.graphdef if isinstance(g, StaticGraph) else g


# Called inside each jitted program: the static graphdefs and the traced states become models again.
def merge_models(tgraph, tstate, dgraph, dstate):
    return nnx.merge(_graph(tgraph), tstate), (nnx.merge(_graph(dgraph), dstate) if dgraph is not None else None)
