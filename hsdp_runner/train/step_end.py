"""What the end of a training step costs per trainable element: ``STEP_END_ACCESSES``.

The trainer ends every optimizer step the same way: gradient clipping (``grad_clip``), then
fused AdamW. Both stream every trainable element of a rank's shard through device memory a
fixed number of times, which the planner prices at the device's memory bandwidth
(``planner.cluster``) and measures that bandwidth with (``planner.linkbench``). The count lives
here, beside the clipping and below the planner, so the planner reads it without importing the
training loop.
"""

# Reads and writes of each trainable shard element at the end of a step (the trainer's
# clipping, then its optimizer step): ``local_norm_square`` reads every gradient for the norm,
# then ``scale_to_norm`` reads and writes it (3); fused AdamW reads the parameter, its gradient
# and both moments and writes the parameter and the moments (7). Gradients and moments have
# the parameter's (master) dtype.
STEP_END_ACCESSES = 3 + 7
