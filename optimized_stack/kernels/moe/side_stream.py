"""The MoE block with the shared expert on a second CUDA stream (toggle
shared_expert_side_stream): slot `moe_block`, (moe, x [T, D]) -> [T, D]."""
from __future__ import annotations

import torch

from ...model.moe import MoE

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def moe_forward_side_stream(self, x: torch.Tensor, *, _tf32: bool = False, _row0: bool = False) -> torch.Tensor:
    """MoE.block with the shared expert on a second stream. The same ops on the same
    shapes as the reference, only overlapped: the side stream waits for x, the main stream
    waits for the shared output before the add, and the allocator is told the tensor is
    used on the main stream (record_stream) so its memory is not handed out early."""
    if not x.is_cuda or not self.cfg.num_shared_experts:
        return MoE.block(self, x)
    main = torch.cuda.current_stream(x.device)
    side = _SIDE.setdefault(x.device, torch.cuda.Stream(x.device))
    side.wait_stream(main)
    # the seeded fault: the side stream's copy of the input broadcasts row 0 (a wrong view)
    x_side = x[:1].expand_as(x) if _row0 else x
    with torch.cuda.stream(side):
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = _tf32 or saved
        try:
            shared = self.shared_experts(x_side)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
    y = self.routed_part(x)
    main.wait_stream(side)
    shared.record_stream(main)
    return y + shared
