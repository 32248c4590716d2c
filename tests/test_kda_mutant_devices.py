"""KDA fault kernels run where their inputs are (the mutants the GPU selftest needs)."""
from __future__ import annotations

import torch


def test_the_decay_after_delta_mutant_stays_on_its_inputs_device():
    """The H200 release run errored on this mutant (a CPU state beside CUDA inputs). The meta
    device stands in for CUDA here: a tensor made without `device=` lands on the CPU and the
    mix raises. Control: the same inputs on the CPU run too."""
    from optimized_stack.kernels.kda.toggle_defs import _recurrent_decay_after_delta
    for device in ("meta", "cpu"):
        q, k, g = (torch.randn(3, 2, 4, device=device) for _ in range(3))
        o, s = _recurrent_decay_after_delta(q, k, torch.randn(3, 2, 4, device=device), g,
                                            torch.rand(3, 2, device=device))
        assert o.device.type == s.device.type == device
