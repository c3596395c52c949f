"""What torchao's float8 training and bitsandbytes' 8-bit AdamW do on this machine with our tiny DiTs (issue #46).

    PYTHONPATH=.:/work/fp8-site OMP_NUM_THREADS=2 python bench/fp8_probe.py [--repeats 5] [--no-compile]

Measured groundwork for the fp8 / optimizer axes; it changes nothing in the training loop. Models are the
tiny DiT and tiny video DiT as models.build_model makes them (data.frames=4, height=8, width=8, 3 channels,
batch 4). It prints:
  a. which nn.Linear layers torchao's float8 training can take (in and out features multiples of 16, the
     torch._scaled_mm constraint torchao's auto filter applies) at the tiny size and model.width=64/96/128;
  b. per recipe (tensorwise, rowwise, rowwise_with_gw_hp, emulate=True), the forward output and the linear
     weights' gradients against bf16 autocast and fp32 on fixed inputs, and the time of a forward+backward
     against bf16 autocast (same process, interleaved);
  c. whether float8 layers compose with CPU bf16 autocast, our attention / modulate kernels,
     torch.func.functional_call + vmap and sweep.run.packed_model.PackedModel, and torch.compile;
  d./e. bitsandbytes' AdamW8bit (and PagedAdamW8bit) and torch.optim.Adafactor on CPU tensors: the state they
     keep and 20 steps of the tiny DiT against torch.optim.AdamW(foreach=False) from the same init and batches.
Exits 2 with one line when torchao or bitsandbytes is missing (they are not project dependencies: install them
with `pip install --no-deps --target /work/fp8-site "torchao==0.18.*" "bitsandbytes==0.50.*"`).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model
from sweep.data.synthetic import SyntheticClips
from sweep.run.diffusion import DiffusionObjective
from sweep.run.fp8 import cast_like_cpu_autocast  # the hook the runs use

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
SHAPE = dict(input_size=8, in_channels=3)
FRAMES, BATCH = 4, 4


def fp8_eligible(mod: nn.Module, fqn: str = "") -> bool:
    """torchao's first rule (float8_linear_utils._auto_filter_for_*): both dims multiples of 16."""
    return isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def tiny(arch: str, width: int | None = None, attention: str = "math", modulate: str = "eager") -> nn.Module:
    frames = FRAMES if arch == "video_dit" else None
    return build_model(arch, "tiny", num_frames=frames, width=width, attention=attention, modulate=modulate, **SHAPE)


def perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """The adaLN-Zero init gives zero gates and a zero output layer (zero grads for most weights): fill every
    all-zero parameter with N(0, 0.02) so every linear gets a gradient, as after some training."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def inputs(arch: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, 3, FRAMES, 8, 8) if arch == "video_dit" else (BATCH, 3, 8, 8)
    return (
        torch.randn(shape, generator=g),
        torch.randint(0, 1000, (BATCH,), generator=g).float(),
        torch.randn(shape, generator=g),
    )


def fp8_config(recipe: str):
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


def to_fp8(model: nn.Module, recipe: str, filt: Callable | None = fp8_eligible, cast: bool = False) -> nn.Module:
    """A float8 copy of model; cast=True adds, per float8 layer, the input cast to the CPU autocast dtype that
    Float8Linear.forward makes only for CUDA autocast (it asks torch.is_autocast_enabled(), CUDA's)."""
    from torchao.float8 import convert_to_float8_training

    converted = convert_to_float8_training(copy.deepcopy(model), config=fp8_config(recipe), module_filter_fn=filt)
    if cast:
        for name in fp8_names(converted):
            converted.get_submodule(name).register_forward_pre_hook(cast_like_cpu_autocast)
    return converted


def fp8_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def fwd_bwd(model: nn.Module, x, t, target, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The prediction (fp32) and every linear weight's gradient (fp32) of one MSE forward+backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        pred = model(x, t)
    F.mse_loss(pred.float(), target).backward()
    grads = {n: m.weight.grad.float().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    return pred.detach().float(), grads


def err(a: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max abs error, relative L2 error, cosine similarity) of a against ref."""
    a, ref = a.double().flatten(), ref.double().flatten()
    rel = ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return (a - ref).abs().max().item(), rel, F.cosine_similarity(a, ref, dim=0).item()


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:150]}"


def section_a() -> None:
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    print("\n== a. which nn.Linear layers torchao's float8 training can take (in, out multiples of 16)")
    for arch in ("dit", "video_dit"):
        for width in (None, 64, 96, 128):
            m = tiny(arch, width)
            linears = [(n, mod) for n, mod in m.named_modules() if isinstance(mod, nn.Linear)]
            refused = [f"{n} ({mod.in_features}->{mod.out_features})" for n, mod in linears if not fp8_eligible(mod)]
            auto = sum(_auto_filter_for_recipe(r, [])(mod, n) for r in ("tensorwise", "rowwise") for n, mod in linears)
            label = f"{arch} width={width or m.hidden_size}{' (tiny default)' if width is None else ''}"
            print(
                f"{label:<34} linears {len(linears):>3}  eligible {len(linears) - len(refused):>3}  "
                f"refused {len(refused)}: {', '.join(refused) or '-'}  | torchao auto filter (H100 size "
                f"thresholds) keeps {auto}"
            )
    m = perturbed(tiny("dit"))
    x, t, target = inputs("dit")
    f = to_fp8(m, "tensorwise", filt=None)
    try:
        fwd_bwd(f, x, t, target, autocast=False)
        ok = "runs"
    except Exception as e:  # noqa: BLE001 - the probe reports what raised
        ok = one_line(e)
    print(f"unfiltered convert_to_float8_training: converts {len(fp8_names(f))} layers, emulated fwd+bwd {ok}")


def section_b(repeats: int) -> None:
    print("\n== b. parity of each recipe (emulate=True) against bf16 autocast and fp32, fixed inputs")
    print("   fp8 layers run under torch.autocast(cpu, bf16) ('fp8+ac') and, for reference, with fp32 around")
    print("   them ('fp8/fp32'); 'fp8+ac+cast' adds the input cast to bf16 (to_fp8's cast=True)")
    print("   rel = ||a-b||/||b||; grads: linear weights, median / max rel over layers")
    for arch in ("dit", "video_dit"):
        model = perturbed(tiny(arch))
        x, t, target = inputs(arch)
        ref32 = fwd_bwd(model, x, t, target, autocast=False)
        refbf = fwd_bwd(model, x, t, target, autocast=True)
        results = {"bf16 autocast": refbf}
        for recipe in RECIPES:
            for autocast, tag, cast in (
                (True, "fp8+ac", False),
                (True, "fp8+ac+cast", True),
                (False, "fp8/fp32", False),
            ):
                f = to_fp8(model, recipe, cast=cast)
                try:
                    results[f"{recipe} {tag}"] = fwd_bwd(f, x, t, target, autocast)
                except Exception as e:  # noqa: BLE001
                    results[f"{recipe} {tag}"] = one_line(e)
        print(f"\n{arch}: {len(ref32[1])} linears, {len(fp8_names(to_fp8(model, 'tensorwise')))} in float8")
        head = f"{'variant':<30}{'out maxabs':>11}{'out rel32':>10}{'out relbf':>10}{'cos32':>9}"
        print(head + f"{'g rel32 med':>12}{'g rel32 max':>12}{'g relbf med':>12}{'g cos32 min':>12}")
        for name, res in results.items():
            if isinstance(res, str):
                print(f"{name:<30} RAISES {res}")
                continue
            o32, obf = err(res[0], ref32[0]), err(res[0], refbf[0])
            g32 = [err(res[1][n], ref32[1][n]) for n in ref32[1]]
            gbf = [err(res[1][n], refbf[1][n]) for n in ref32[1]]
            print(
                f"{name:<30}{o32[0]:>11.2e}{o32[1]:>10.2e}{obf[1]:>10.2e}{o32[2]:>9.6f}"
                f"{statistics.median(e[1] for e in g32):>12.2e}{max(e[1] for e in g32):>12.2e}"
                f"{statistics.median(e[1] for e in gbf):>12.2e}{min(e[2] for e in g32):>12.6f}"
            )
        if arch == "dit":
            per_layer(ref32, refbf, results)
        timing(arch, model, x, t, target, repeats)


def per_layer(ref32, refbf, results) -> None:
    """Per-layer gradient error of the tiny DiT: relative L2 error against fp32 for bf16 and each recipe."""
    cols = ["bf16 autocast"] + [f"{r} fp8+ac" for r in RECIPES] + ["rowwise_with_gw_hp fp8+ac+cast"]
    cols = [c for c in cols if not isinstance(results[c], str)]
    print("\nper-layer weight-gradient rel error against fp32 (dit):")
    print(
        f"{'layer':<34}"
        + "".join(f"{c.replace(' fp8+ac', '').replace('rowwise_with_gw_hp', 'gw_hp'):>18}" for c in cols)
    )
    for n in ref32[1]:
        print(f"{n:<34}" + "".join(f"{err(results[c][1][n], ref32[1][n])[1]:>18.2e}" for c in cols))


def timing(arch, model, x, t, target, repeats: int) -> None:
    variants = {"bf16 autocast": (model, True)}
    for recipe in RECIPES:
        variants[f"{recipe} fp8+ac+cast"] = (to_fp8(model, recipe, cast=True), True)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for m, ac in variants.values():  # warm-up
        fwd_bwd(m, x, t, target, ac)
    for _ in range(repeats):
        for k, (m, ac) in variants.items():
            start = time.perf_counter()
            fwd_bwd(m, x, t, target, ac)
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times["bf16 autocast"])
    print(f"\nfwd+bwd time, {arch}, median of {repeats} interleaved (shared 2-core machine; ratios, not speeds):")
    for k, v in times.items():
        print(f"  {k:<30}{1e3 * statistics.median(v):>8.1f} ms  x{statistics.median(v) / base:.2f}")


def try_run(fn: Callable[[], object]) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return "RAISES " + one_line(e)


def section_c(compile_too: bool) -> None:
    from torch.func import functional_call, stack_module_state, vmap

    from sweep.run.packed_model import PackedModel

    print("\n== c. composition with what our runs use (dit, fwd+bwd under bf16 autocast unless said)")
    x, t, target = inputs("dit")
    for attention in ("math", "flash", "eager"):
        for modulate in ("eager", "fused"):
            base = perturbed(tiny("dit", attention=attention, modulate=modulate))
            for cast in (False, True):
                row = [
                    f"{r}: {try_run(lambda r=r, b=base, c=cast: fwd_bwd(to_fp8(b, r, cast=c), x, t, target, True))}"
                    for r in RECIPES
                ]
                print(f"attention={attention:<6} modulate={modulate:<6} cast={cast!s:<5} " + " | ".join(row))
    base = perturbed(tiny("dit"))
    f = to_fp8(base, "tensorwise")

    def functional() -> None:
        params = {**dict(f.named_parameters()), **dict(f.named_buffers())}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = functional_call(f, params, (x, t))
        F.mse_loss(out.float(), target).backward()

    print(f"functional_call (tensorwise, one model): {try_run(functional)}")

    def vmapped() -> None:
        models = [to_fp8(perturbed(tiny("dit"), seed=s), "tensorwise") for s in (0, 1)]
        params, buffers = stack_module_state(models)
        skeleton = copy.deepcopy(models[0]).to("meta")
        xs, ts = x.expand(2, *x.shape), t.expand(2, *t.shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = vmap(lambda p, b, xx, tt: functional_call(skeleton, (p, b), (xx, tt)))(params, buffers, xs, ts)
        out.float().pow(2).mean().backward()

    print(f"vmap(functional_call) over 2 stacked float8 models (the packed path's core): {try_run(vmapped)}")

    def packed() -> str:
        plain = [perturbed(tiny("dit"), seed=s) for s in (0, 1)]
        xs, ts = x.expand(2, *x.shape), t.expand(2, *t.shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = PackedModel([to_fp8(m, "tensorwise") for m in plain])(xs, ts)
            b = PackedModel(plain)(xs, ts)
        same = torch.equal(a, b)
        return f"runs; output {'bit-identical to' if same else 'differs from'} the bf16 pack's"

    try:
        print(f"sweep.run.packed_model.PackedModel of float8 models: {packed()}")
    except Exception as e:  # noqa: BLE001
        print(f"sweep.run.packed_model.PackedModel of float8 models: RAISES {one_line(e)}")
    if not compile_too:
        print("torch.compile: skipped (--no-compile)")
        return
    for recipe in ("tensorwise", "rowwise"):
        torch._dynamo.reset()
        g = torch.compile(to_fp8(base, recipe))
        start = time.perf_counter()
        res = try_run(lambda g=g: fwd_bwd(g, x, t, target, True))
        print(
            f"torch.compile (inductor) {recipe} fwd+bwd under bf16 autocast: {res} "
            f"({time.perf_counter() - start:.0f} s)"
        )


def batches(arch: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`steps` fixed (noisy, t, target) batches of the synthetic data, through our DDPM objective."""
    data = SyntheticClips(steps * BATCH, frames=1, channels=3, height=8, width=8, seed=0, as_images=True)
    objective, g = DiffusionObjective("ddpm"), torch.Generator().manual_seed(0)
    return [objective.sample(torch.stack([data[i * BATCH + j] for j in range(BATCH)]), g) for i in range(steps)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data, marks=(1, 5, 20)) -> tuple[list[float], dict]:
    losses, snaps = [], {}
    for step, (noisy, t, target) in enumerate(data, start=1):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(noisy, t), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step in marks:
            snaps[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, snaps


def state_summary(opt: torch.optim.Optimizer, model: nn.Module) -> tuple[str, list[str]]:
    """The optimizer state's (key: dtype) kinds with counts, and the parameters without a uint8 state."""
    names = {id(p): n for n, p in model.named_parameters()}
    kinds: dict[str, int] = {}
    wide = []
    for p, st in opt.state.items():
        kind = ", ".join(f"{k}:{str(v.dtype).replace('torch.', '')}" for k, v in st.items() if torch.is_tensor(v))
        kinds[kind] = kinds.get(kind, 0) + 1
        if not any(torch.is_tensor(v) and v.dtype == torch.uint8 for v in st.values()):
            wide.append(f"{names[id(p)]}({p.numel()})")
    return "; ".join(f"{n} x [{k}]" for k, n in kinds.items()), wide


def compare(label: str, make: Callable, lr: float, ref: tuple, init: dict, data) -> None:
    """Train a fresh tiny DiT from `init` with make(params) and print its loss and weights against ref."""
    model = tiny("dit")
    model.load_state_dict(init)
    try:
        opt = make(model.parameters(), lr)
        losses, snaps = train(model, opt, data)
    except Exception as e:  # noqa: BLE001
        print(f"{label}: RAISES {one_line(e)}")
        return
    kinds, wide = state_summary(opt, model)
    print(f"\n{label}: state {kinds}")
    if any("uint8" in k for k in kinds.split(";")):
        print(f"  kept 32-bit (no uint8 state): {len(wide)} tensors: {', '.join(wide)}")
    ref_losses, ref_snaps = ref
    for step in (1, 5, 20):
        by_max = {
            n: ((w - ref_snaps[step][n]).abs().max() / ref_snaps[step][n].abs().max()).item()
            for n, w in snaps[step].items()
        }
        by_upd = {
            n: ((w - ref_snaps[step][n]).norm() / (ref_snaps[step][n] - init[n]).norm()).item()
            for n, w in snaps[step].items()
            if (ref_snaps[step][n] - init[n]).norm() > 0
        }
        worst_max, worst_upd = max(by_max, key=by_max.get), max(by_upd, key=by_upd.get)
        print(
            f"  after {step:>2} steps: max|w-w_ref|/max|w_ref| {by_max[worst_max]:.2e} ({worst_max}); "
            f"||w-w_ref||/||w_ref-w0|| {by_upd[worst_upd]:.2e} ({worst_upd}), "
            f"median {statistics.median(by_upd.values()):.2e}"
        )
    zero = [n for n, v in init.items() if not v.any() and n in snaps[20]]
    moved = max(snaps[20][n].abs().max().item() for n in zero)
    moved_ref = max(ref_snaps[20][n].abs().max().item() for n in zero)
    print(
        f"  the {len(zero)} zero-init (adaLN-Zero) tensors after 20 steps: max|w| {moved:.2e} (AdamW: {moved_ref:.2e})"
    )
    print(f"  {'step':>4}{'AdamW fp32':>12}  {label.split(' (')[0]:>24}")
    for i in (0, 1, 2, 4, 9, 14, 19):
        print(f"  {i + 1:>4}{ref_losses[i]:>12.5f}  {losses[i]:>24.5f}")


def section_de(lr: float) -> None:
    import bitsandbytes as bnb

    print(f"\n== d./e. 8-bit AdamW and Adafactor against torch AdamW(foreach=False), tiny DiT, lr {lr}, 20 steps")
    data = batches("dit", 20)
    init = {k: v.clone() for k, v in tiny("dit").state_dict().items()}
    ref_model = tiny("dit")
    ref_model.load_state_dict(init)
    kw = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref = train(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=lr, foreach=False, **kw), data)
    p = torch.randn(4096, requires_grad=True)
    p.grad = torch.randn(4096)
    probe = bnb.optim.AdamW8bit([p], lr=lr)
    probe.step()
    print(f"bnb {bnb.__version__} AdamW8bit on a CPU tensor: steps; state {state_summary(probe, nn.Linear(1, 1))[0]}")
    compare(
        "bnb.optim.AdamW8bit (min_8bit_size=4096, default)",
        lambda ps, lr: bnb.optim.AdamW8bit(ps, lr=lr, **kw),
        lr,
        ref,
        init,
        data,
    )
    compare(
        "bnb.optim.AdamW8bit (min_8bit_size=16)",
        lambda ps, lr: bnb.optim.AdamW8bit(ps, lr=lr, min_8bit_size=16, **kw),
        lr,
        ref,
        init,
        data,
    )
    if hasattr(bnb.optim, "PagedAdamW8bit"):
        compare(
            "bnb.optim.PagedAdamW8bit", lambda ps, lr: bnb.optim.PagedAdamW8bit(ps, lr=lr, **kw), lr, ref, init, data
        )
    if hasattr(torch.optim, "Adafactor"):
        for a_lr in (lr, 1e-2):  # 1e-2 is torch's default: Adafactor's lr caps a step relative to RMS(weight)
            make = lambda ps, _, a_lr=a_lr: torch.optim.Adafactor(ps, lr=a_lr, foreach=False)  # noqa: E731
            compare(f"torch.optim.Adafactor (lr={a_lr:g}, foreach=False)", make, lr, ref, init, data)
    else:
        print(f"torch.optim.Adafactor: absent in torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timed fwd+bwd per variant")
    ap.add_argument("--lr", type=float, default=1e-3, help="lr of the 20-step optimizer comparisons")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile check (inductor, slow cold)")
    args = ap.parse_args()
    try:
        import bitsandbytes
        import torchao
    except ImportError as e:
        print(
            f"fp8_probe: {e.name} is not installed "
            "(pip install --no-deps --target DIR torchao bitsandbytes; PYTHONPATH=.:DIR)"
        )
        sys.exit(2)
    print(
        f"torch {torch.__version__}, torchao {torchao.__version__}, bitsandbytes {bitsandbytes.__version__}, "
        f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    torch.manual_seed(0)
    section_a()
    section_b(args.repeats)
    section_c(not args.no_compile)
    section_de(args.lr)


if __name__ == "__main__":
    main()
