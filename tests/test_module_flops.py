"""module_flops (sweep/run/module_flops.py): per-module forward FLOPs of known models, names as named_modules'."""

from __future__ import annotations

import torch

from sweep.run.build import build_parts, reset_process_state
from sweep.run.module_flops import module_flops
from sweep.run.precision import PrecisionPolicy

from .conftest import make_run


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.act = torch.nn.GELU()
        self.second = torch.nn.Sequential(torch.nn.Linear(16, 4))

    def forward(self, x):
        return self.second(self.act(self.first(x)))


def test_a_linear_costs_2_m_k_n():
    assert module_flops(torch.nn.Linear(8, 16), [torch.randn(4, 8)]) == {"": 2 * 4 * 8 * 16}


def test_nested_modules_count_inclusively_under_their_names():
    flops = module_flops(Two(), [torch.randn(4, 8)])
    first, second = 2 * 4 * 8 * 16, 2 * 4 * 16 * 4
    assert flops == {"": first + second, "first": first, "second": second, "second.0": second}


def test_the_video_dit_blocks_share_the_model_and_names_match_named_modules():
    run = make_run("device=cpu", "threads=1")
    policy = PrecisionPolicy.from_config(run.precision, torch.device("cpu"))
    reset_process_state(run, policy)
    parts = build_parts(run, torch.device("cpu"), policy)
    x = torch.stack([parts.dataset[i] for i in range(2)])
    flops = module_flops(parts.model, [x, torch.tensor([3, 500])])
    names = {n for n, _ in parts.model.named_modules()}
    assert set(flops) <= names
    blocks = [n for n in flops if n.count(".") == 1 and n.startswith("blocks.")]
    assert blocks and sum(flops[n] for n in blocks) < flops[""]
    assert flops["blocks.0"] == flops["blocks.0.attn"] + flops["blocks.0.mlp"] + flops.get(
        "blocks.0.adaLN_modulation", 0
    )
