"""fp16's dynamic loss scaling (config precision='fp16'): the loss is multiplied by a scale that
halves when a step's gradients overflow (that step is skipped on every rank) and doubles after
`loss_scale_window` clean steps."""
from __future__ import annotations


class LossScaler:
    """Dynamic loss scaling for fp16: halve on overflow, double after `window` clean steps."""

    def __init__(self, initial: float, window: int):
        self.scale = float(initial)
        self.window = window
        self.clean_steps = 0
        self.grads_scale = self.scale  # the scale the gradients now accumulating were computed with

    def scale_loss(self, loss):
        """The loss to differentiate: times the current scale, which its gradients then carry (a
        delayed update may change `scale` before they are stepped)."""
        self.grads_scale = self.scale
        return loss.float() * self.scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps % self.window == 0:
                self.scale *= 2

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        """What state_dict() gave (a checkpoint's loss scale)."""
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
