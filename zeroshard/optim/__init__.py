"""Floor 5, the step on this rank's fp32 masters: the sharded optimizer and the delayed update
(optimizer.py, delayed_update.py), bringing an update into the compute parameters (publish.py),
what ranks agree on before a step (grad_agreement.py), a window's gradients made ready for the
step and torch's clip_grad_norm_ measured on them (window_gradients.py), loss scaling
(loss_scale.py), the user's param groups (param_groups.py), the tiled step (tiled_step.py) with its
exact Adam kernel (exact_adam.py) and the CPU Adam (cpu_adam.py); both kernels are in csrc/, built
on first use (kernels.py)."""
