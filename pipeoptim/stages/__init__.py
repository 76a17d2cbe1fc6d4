"""From a user's model to the modules a pipeline's stages run, below the runtime that runs them.

- ``partition``: which layers go to which stage (even, by count, or balanced by measured time).
- ``balance``: the cut a ``Pipeline`` makes of ``balance=`` (counts, even, or ``"time"`` profiled on one rank).
- ``model_cut``: a model cut into stages, each process building only its own (``meta`` builds included).
- ``materialize``: a ``meta``-device layer made real and initialised deterministically from its global name.
- ``copies``: parameters that start as a copy of another stage's (tied embeddings under asynchronous schedules).
- ``recompute``: which stages and layers recompute their activations in the backward.
"""
