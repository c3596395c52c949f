"""Each module's share of a model's forward FLOPs, measured by torch's FlopCounterMode.

The differential diagnosis (issue #29) weighs "this module group in fp32 fixes it" against what the group
costs: a fix that keeps 40% of the FLOPs in fp32 is not the same finding as one that keeps 2%. FlopCounterMode
counts the FLOPs of the matmul-like ops it knows (mm, addmm, bmm, baddbmm, convolution, SDPA, ...) and credits
each op to every module whose forward is running, so a parent's count includes its children's. Elementwise
ops (norms, activations, modulate) count 0, as in torch's own table.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode


def module_flops(model: torch.nn.Module, example_inputs: Sequence[Any]) -> dict[str, int]:
    """{module name: forward FLOPs} of one no-grad forward `model(*example_inputs)`, names as in
    `model.named_modules()` ("" is the whole model), inclusive of submodules; modules that ran no counted op
    are left out. A module shared under two names is counted under the first."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*example_inputs)
    root = type(model).__name__
    flops = {}
    for name, per_op in counter.get_flop_counts().items():
        if name == "Global":
            continue
        ours = "" if name == root else name.removeprefix(root + ".")
        total = sum(per_op.values())
        if total:
            flops[ours] = total
    return flops
