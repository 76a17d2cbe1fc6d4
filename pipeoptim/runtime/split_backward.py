"""A chunk's backward in two passes: the input gradient now (``I``), the weight gradient later (``W``).

Zero-bubble schedules send the input gradient upstream as soon as it exists and fill idle time with the weight
gradient. Autograd computes both in one walk of the graph, so the walk is split at the nodes where a parameter's
branch joins the path from the chunk's outputs to its inputs:

- ``input_pass`` walks outputs -> inputs (``torch.autograd.grad`` on the inputs, graph retained). Each node on
  that path that also feeds a parameter's branch (a "frontier" node, e.g. the ``mm`` of a linear layer, whose
  other operand is the weight) records the gradient arriving at it.
- ``weight_pass`` later starts at the frontier nodes with those recorded gradients and walks only towards the
  parameters, so nothing of the input pass is computed twice. Parameters whose branches meet at a frontier node
  are one group, walked together; a group whose parameter feeds several frontier nodes (a weight used twice)
  pins each of them to its recorded gradient, so a path from one frontier to the next cannot count twice.
  The gradients are accumulated into ``param.grad`` in place, exactly where an unsplit backward puts them.

A chunk whose inputs need no gradient (stage 0 reads token ids) has no input pass: its ``W`` runs the whole
backward. Both passes run whatever saved-tensor hooks were active at the forward (the weight policy's), at the
time each pass runs.

Activation checkpointing (``pipeoptim.stages.recompute``, torch's non-reentrant checkpoint) recomputes a region once per
autograd call that reaches it: the input pass recomputes once, and the weight pass runs its calls (one per
parameter group) in one ``torch.utils.checkpoint.GraphExecGroup``, so it recomputes once more, not once per group
(the groups walk disjoint parts of the graph, which that context requires).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.checkpoint import GraphExecGroup

__all__ = ["WeightGradWork", "input_pass", "weight_pass"]


@dataclass
class _Group:
    params: list[torch.Tensor]
    frontier: list = field(default_factory=list)          # autograd nodes where the group's branches join
    grads: dict = field(default_factory=dict)             # node -> gradients recorded at it in the input pass


@dataclass
class WeightGradWork:
    """What ``input_pass`` leaves for ``weight_pass``: the frontier gradients per parameter group, or the whole
    backward (``outputs``/``grad_outputs``) when no input needed a gradient."""
    groups: list[_Group] = field(default_factory=list)
    params: Sequence[torch.Tensor] = ()
    outputs: Sequence[torch.Tensor] = ()
    grad_outputs: Sequence[torch.Tensor] | None = None
    whole: bool = False                                  # W runs the whole backward (no input pass happened)
    reroot: bool = False                                 # W walks from the outputs to the parameters
    keep: tuple = ()                                      # outputs and inputs: the graph lives until W


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def _reverse_graph(roots: list) -> dict:
    """node -> the nodes whose gradients flow into it (its consumers in the forward), over the graph of roots."""
    parents: dict = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _reaching(targets: list, parents: dict) -> set:
    """Every node from which some node of ``targets`` can be reached (targets included)."""
    out = set(targets)
    queue = deque(targets)
    while queue:
        for p in parents.get(queue.popleft(), ()):
            if p not in out:
                out.add(p)
                queue.append(p)
    return out


def _groups(params: list[torch.Tensor], on_input_path: set, parents: dict, roots: set) -> list[_Group]:
    """Parameters grouped by the frontier nodes their branches reach first (walking from the parameter towards
    the outputs, stopping at the input path); a root off the input path is a frontier too."""
    frontier_of: dict[int, set] = {}
    for i, p in enumerate(params):
        start = _node(p)
        hits, seen, queue = set(), {start}, deque([start])
        while queue:
            node = queue.popleft()
            for q in parents.get(node, ()):
                if q in seen:
                    continue
                seen.add(q)
                if q in on_input_path:
                    hits.add(q)
                else:
                    if q in roots:
                        hits.add(q)
                    queue.append(q)
        if start in roots:
            hits.add(start)
        frontier_of[i] = hits
    # union parameters that share a frontier node
    owner: dict = {}
    link = list(range(len(params)))

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i
    for i, hits in frontier_of.items():
        for node in hits:
            if node in owner:
                link[find(i)] = find(owner[node])
            else:
                owner[node] = i
    groups: dict[int, _Group] = {}
    for i, p in enumerate(params):
        if not frontier_of[i]:
            continue                                     # not reached from the outputs: no gradient, as unsplit
        g = groups.setdefault(find(i), _Group([]))
        g.params.append(p)
        for node in frontier_of[i]:
            if node not in g.frontier:
                g.frontier.append(node)
    return list(groups.values())


def input_pass(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor] | None,
               inputs: Sequence, params: Sequence[torch.Tensor]) -> tuple[tuple, WeightGradWork]:
    """Gradients of ``inputs`` (None where an input needs none) and what the weight pass needs.

    outputs:       the chunk's outputs that carry gradient (the loss on the last stage).
    grad_outputs:  their gradients (None: outputs are scalars, gradient 1).
    params:        the chunk's parameters that require a gradient.
    """
    outputs = [o for o in outputs]
    want = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    params = [p for p in params if p.requires_grad]
    work = WeightGradWork(outputs=outputs, grad_outputs=grad_outputs, keep=(tuple(outputs), tuple(inputs)))
    if not want or not outputs:
        work.whole = True
        return tuple(None for _ in inputs), work
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    parents = _reverse_graph(roots)
    on_input_path = _reaching([_node(inputs[i]) for i in want], parents)
    # An output computed without the inputs that also feeds another output has no single recorded gradient:
    # for such (rare) graphs W walks from the outputs to the parameters instead (correct, not cheaper).
    work.reroot = any(r not in on_input_path and parents.get(r) for r in roots)
    if not work.reroot:
        work.groups = _groups(params, on_input_path, parents, set(roots))
    work.params = params
    for_roots = {}                                       # gradients given for roots off the input path
    for k, o in enumerate(outputs):
        if o.grad_fn is not None and o.grad_fn not in on_input_path:
            g = torch.ones_like(o) if grad_outputs is None else grad_outputs[k]
            for_roots.setdefault(o.grad_fn, {})[o.output_nr] = g
    handles = []
    try:
        for group in work.groups:
            for node in group.frontier:
                if node in for_roots:
                    n_out = max(for_roots[node]) + 1
                    group.grads[node] = tuple(for_roots[node].get(j) for j in range(n_out))
                else:
                    handles.append(node.register_prehook(_recorder(group.grads, node)))
        grads = torch.autograd.grad(outputs, [inputs[i] for i in want], grad_outputs, retain_graph=True,
                                    allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    result = [None] * len(inputs)
    for i, g in zip(want, grads):
        result[i] = g
    return tuple(result), work


def _recorder(store: dict, node):
    def hook(grad_outputs):
        store[node] = tuple(grad_outputs)
    return hook


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is None:
        return
    if p.grad is None:
        p.grad = g.detach().clone()
    else:
        p.grad.add_(g)


def weight_pass(work: WeightGradWork) -> None:
    """Accumulate the weight gradients that ``input_pass`` deferred into each parameter's ``.grad``."""
    if work.whole:
        if work.outputs:
            torch.autograd.backward(list(work.outputs), work.grad_outputs)
        return
    if work.reroot:
        dws = torch.autograd.grad(list(work.outputs), list(work.params), work.grad_outputs, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(work.params, dws):
                _accumulate(p, g)
        return
    with GraphExecGroup():
        for group in work.groups:
            _weight_group(group)
    work.groups = []


def _weight_group(group: _Group) -> None:
    """One parameter group's weight gradients, from its frontier nodes' recorded gradients."""
    edges, grads = [], []
    for node in group.frontier:
        for j, g in enumerate(group.grads.get(node, ())):
            if g is not None:
                edges.append(GradientEdge(node, j))
                grads.append(g)
    if not edges:
        return
    pins = []
    if len(group.frontier) > 1:   # a path from one frontier node to another must not add to the recorded one
        for node in group.frontier:
            recorded = group.grads.get(node)
            if recorded is not None:
                pins.append(node.register_prehook(lambda _, r=recorded: r))
    try:
        dws = torch.autograd.grad(edges, [get_gradient_edge(p) for p in group.params], grads,
                                  retain_graph=True, allow_unused=True)
    finally:
        for h in pins:
            h.remove()
    with torch.no_grad():
        for p, g in zip(group.params, dws):
            _accumulate(p, g)
