"""Factories for tests/test_custom_model.py, named as `model.target=tests.custom_factories:<name>`."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.modulate import modulate

NOT_CALLABLE = 3


class NoAttention(nn.Module):
    """A per-voxel MLP: no SDPA call, no models.modulate call."""

    def __init__(self, channels: int, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(channels + 1, width), nn.GELU(), nn.Linear(width, channels))

    def forward(self, x, t):
        h = x.movedim(1, -1)  # (B, ..., C)
        tt = (t / 1000).to(h.dtype).view(-1, *([1] * (h.dim() - 1))).expand(*h.shape[:-1], 1)
        return self.net(torch.cat([h, tt], dim=-1)).movedim(-1, 1)


def no_attention(channels: int, width: int = 16) -> nn.Module:
    return NoAttention(channels, width)


class Tokens(nn.Module):
    """Pixels as tokens, one SDPA call, one modulate call with impl omitted (the adapter supplies it)."""

    def __init__(self, channels: int, dim: int = 16):
        super().__init__()
        self.inp, self.qkv, self.ada, self.out = (
            nn.Linear(channels, dim),
            nn.Linear(dim, 3 * dim),
            nn.Linear(1, 2 * dim),
            nn.Linear(dim, channels),
        )

    def forward(self, x, t):
        b, c = x.shape[:2]
        h = self.inp(x.reshape(b, c, -1).transpose(1, 2))  # (B, N, dim)
        q, k, v = self.qkv(h)[:, None].chunk(3, dim=-1)  # (B, 1, N, dim) each
        h = h + F.scaled_dot_product_attention(q, k, v)[:, 0]
        shift, scale = self.ada((t / 1000)[:, None].to(h.dtype)).chunk(2, dim=1)
        h = modulate(h, shift, scale)  # impl from the adapter
        return self.out(h).transpose(1, 2).reshape(x.shape)


def tokens(channels: int, dim: int = 16) -> nn.Module:
    return Tokens(channels, dim)


def image_tokens(channels: int) -> nn.Module:
    return Tokens(channels)


image_tokens.is_image = True


def raises(channels: int) -> nn.Module:
    raise RuntimeError("no weights for this size")


def not_a_module() -> int:
    return 42


def wrong_shape(channels: int) -> nn.Module:
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x, t):
            return x[:, :1] * self.w

    return Half()


def not_a_module_unannotated():
    return 42


def returns_none_annotated(channels: int) -> None:
    raise AssertionError("called: a factory annotated to return None must be refused before any call")


def returns_str_annotation(channels: int) -> "str":
    raise AssertionError("called: a factory annotated to return str must be refused before any call")


def unresolvable_annotation(channels: int) -> "NoSuchType":  # noqa: F821  (unresolvable: allowed, called)
    return tokens(channels)


def module_or_none(channels: int) -> "nn.Module | None":
    return tokens(channels)


class NotAModule:
    def __init__(self, **kwargs):
        raise AssertionError("called: a class that is no nn.Module must be refused before any call")


NOT_CALLABLE_C = len  # a builtin


def returns_a_tuple(channels: int) -> nn.Module:
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x, t):
            return x * self.w, t

    return Pair()


def forward_raises(channels: int) -> nn.Module:
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x, t):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    return Broken()


HUGE_BUILT_ON: list[str] = []
"""The device each build of `huge` allocated on (tests/test_custom_model.py: only ever "meta")."""


def huge(channels: int, dim: int = 66_000) -> nn.Module:
    """4.4G parameters: must be refused on the meta device, never built for real."""
    model = nn.Sequential(nn.Linear(dim, dim, bias=False))
    HUGE_BUILT_ON.append(model[0].weight.device.type)  # past the limit the count goes on on the meta device: meta
    return model


def needs_real_tensors(channels: int) -> nn.Module:
    """Reads a tensor's value while it builds (timm's drop-path rates): cannot build on the meta device."""
    rates = [x.item() for x in torch.linspace(0, 0.1, 2)]
    assert rates[0] == 0.0
    return tokens(channels)


FACTORY_CALLS = {"outside_dit": 0}
"""How many times outside_dit was called (tests count the models a sweep builds)."""


class TimestepEmbedder(nn.Module):
    """DiT's timestep embedder as outside code writes it (facebookresearch/DiT models.py): float32 sinusoidal
    features fed to the MLP without a cast, so under a pure precision its first Linear gets float32."""

    def __init__(self, hidden: int, frequency_embedding_size: int = 32):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    @staticmethod
    def timestep_embedding(t, dim: int, max_period: int = 10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class OutsideDiT(nn.Module):
    """An image model with that embedder: pixels as tokens plus the timestep embedding."""

    def __init__(self, channels: int, dim: int = 16):
        super().__init__()
        self.inp, self.t_embedder, self.out = nn.Linear(channels, dim), TimestepEmbedder(dim), nn.Linear(dim, channels)

    def forward(self, x, t):
        b, c = x.shape[:2]
        h = self.inp(x.reshape(b, c, -1).transpose(1, 2)) + self.t_embedder(t)[:, None]  # (B, N, dim)
        return self.out(h).transpose(1, 2).reshape(x.shape)


def outside_dit(channels: int) -> nn.Module:
    FACTORY_CALLS["outside_dit"] += 1
    return OutsideDiT(channels)


outside_dit.is_image = True


HUGE_WEIGHT_ON: list[str] = []
"""The device huge_on_cpu's weight ended on (tests/test_custom_model.py: only ever "meta")."""


def huge_on_cpu(channels: int, dim: int = 33_000) -> nn.Module:
    """1.09G parameters (4.4 GB), built with an explicit device="cpu" and moved with .to("cpu") as outside code does:
    `with torch.device("meta")` alone does not override either, so it was built for real before the refusal."""
    model = nn.Sequential(nn.Linear(dim, dim, bias=False, device="cpu")).to("cpu")
    HUGE_WEIGHT_ON.append(model[0].weight.device.type)
    return model


popen_alias = __import__("os").popen  # a user module re-exporting the standard library's function

partial_factory = __import__("functools").partial(tokens, dim=8)


class CallableFactory:
    def __call__(self, channels: int) -> nn.Module:
        return tokens(channels)


callable_factory = CallableFactory()

CALLS: dict[str, int] = {}
"""Calls of `counted`, by its `tag` kwarg (a fresh tag per test: the probe is cached per distinct call)."""


def counted(channels: int, tag: str = "") -> nn.Module:
    CALLS[tag] = CALLS.get(tag, 0) + 1
    return tokens(channels)


def huge_then_reads(channels: int, dim: int = 66_000) -> nn.Module:
    """Past the limit, then reads a value (a meta tensor has none): refused with what it counted, never allocated."""
    model = nn.Sequential(nn.Linear(dim, dim, bias=False))
    assert model[0].weight.abs().max().item() < 1.0
    return model


class _Scale(nn.Module):
    """x times one weight, then `out(x, y)`: the base of the models below that pass the probe's forward on a
    batch of 2 and cannot train."""

    def __init__(self, out):
        super().__init__()
        self.w, self.out = nn.Parameter(torch.ones(())), out

    def forward(self, x, t):
        return self.out(x, x * self.w)


def batch_of_two_only(channels: int) -> nn.Module:
    """The right shape at the probe's batch of 2 only: it keeps the first two samples."""
    return _Scale(lambda x, y: y[:2])


def reshapes_to_two(channels: int) -> nn.Module:
    """A batch of 2 hard-coded in a reshape: any other batch raises."""
    return _Scale(lambda x, y: y.reshape(2, *x.shape[1:]))


def no_parameters(channels: int) -> nn.Module:
    """Nothing to train: a module without parameters."""

    class Half(nn.Module):
        def forward(self, x, t):
            return x * 0.5

    return Half()


def frozen(channels: int) -> nn.Module:
    """Nothing to train: every parameter has requires_grad=False."""
    model = _Scale(lambda x, y: y)
    model.requires_grad_(False)
    return model


def no_grad_forward(channels: int) -> nn.Module:
    """A forward under torch.no_grad(): its prediction has no grad_fn, so no gradient reaches the weights."""

    class NoGrad(_Scale):
        def forward(self, x, t):
            with torch.no_grad():
                return super().forward(x, t)

    return NoGrad(lambda x, y: y)


def detached_output(channels: int) -> nn.Module:
    """Its prediction detached from the graph: no gradient reaches the weights."""
    return _Scale(lambda x, y: y.detach())
