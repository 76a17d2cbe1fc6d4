"""Weight prediction, below the schedules and the policies: what a stage's weights will be a few updates ahead.

- ``flat``: a module's parameters and a ``torch.optim`` optimizer's state gathered into flat buffers, one per
  group, so that the kernels of ``pipeoptim_kernels`` predict a whole stage in one call (``flat_groups``: how the
  parameters fall into groups; ``optimizer_rules``: which kernel rule steps with which optimizer).
- ``predictor``: ŵ = w − s·lr·Δ over those buffers, swapped into the module for a forward and back.
- ``last_update``: Δ as the last applied update, for an optimizer whose rule the kernels do not know.
"""
