"""Checkpoints you can trust: safetensors files, a SHA-256 manifest, and a check before anything loads.

    python -m sweep checkpoint.every=10                                 # save every 10 steps
    python -m sweep checkpoint.resume_from=outputs/runs/.../checkpoints/step_000010
    python -m sweep model.init_from=outputs/runs/.../checkpoints/step_000050   # weights only

One checkpoint is a directory, written under a temporary name and renamed when complete, so a
reader never sees half of one:

    model.safetensors      the weights (parameters and persistent buffers)
    optimizer.safetensors  AdamW state by parameter name: <name>.exp_avg, <name>.exp_avg_sq, <name>.step (another
                           optim.name: its library's state tensors, <name>.<key>, in their own dtypes)
    trainer.safetensors    RNG states (diffusion noise, torch CPU, CUDA) and the monitor's weight snapshot
    trainer.json           the next step, the device type that wrote it, the loss-scaler state, the monitor's numbers
    manifest.json          format, step, and the SHA-256 of every file and of every tensor in it

Nothing here unpickles: safetensors holds raw tensors only, and a `.pt` weights file is read with
`torch.load(weights_only=True)`. Loading (`verify=True`) checks every file against the manifest and
scans every floating tensor for NaN/Inf first; a mismatch names the file and the tensor (the
per-tensor hashes find which tensor a flipped byte landed in) and the run ends with verdict
`corrupt_checkpoint` before its first step. The Hallo post-mortem is what this prevents: a corrupted
pretrained file loaded silently, NaN predictions, the loss scaler halving down to its minimum.

With the data order a pure function of the step and every RNG state restored, a run resumed at step k
computes exactly the losses the uninterrupted run computed from step k on (tests/test_checkpoint.py).
That holds on the device type that wrote the checkpoint: the diffusion-noise generator is the device's
own (a CPU Mersenne Twister state is 5056 bytes, a CUDA Philox state 16), and no state of one continues
the other's stream. A resume on another device type is refused before any step, in one line that names
both devices (`device_mismatch`); its weights alone still load there with `model.init_from`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sweep.config import WEIGHT_SUFFIXES
from sweep.run import optimizers

log = logging.getLogger("sweep")

FORMAT = "dit-sweep-checkpoint/1"
MANIFEST = "manifest.json"
MODEL_FILE, OPTIM_FILE, TRAINER_FILE, TRAINER_JSON = (
    "model.safetensors",
    "optimizer.safetensors",
    "trainer.safetensors",
    "trainer.json",
)


class CorruptCheckpoint(Exception):
    """A checkpoint or weights file that must not be loaded: verdict `corrupt_checkpoint`."""

    def __init__(self, file: str, tensor: str | None, detail: str) -> None:
        super().__init__(f"{file}: {detail}")
        self.file, self.tensor, self.detail = file, tensor, detail


# ---- hashing and the safetensors layout --------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes sit in a safetensors file."""

    dtype: str
    start: int  # absolute byte offsets
    end: int


def tensor_spans(path: Path) -> dict[str, TensorSpan]:
    """Parse a safetensors header (an 8-byte little-endian length, then JSON) into absolute byte spans."""
    raw = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        base = 8 + n
        return {
            name: TensorSpan(e["dtype"], base + e["data_offsets"][0], base + e["data_offsets"][1])
            for name, e in header.items()
            if name != "__metadata__"
        }
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(Path(path).name, None, f"unreadable safetensors header ({type(e).__name__})") from e


def tensor_digests(path: Path) -> dict[str, str]:
    """SHA-256 of each tensor's raw bytes: the manifest keeps them so a bad byte is traced to its tensor."""
    raw = Path(path).read_bytes()
    return {name: hashlib.sha256(raw[s.start : s.end]).hexdigest() for name, s in tensor_spans(path).items()}


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; one safetensors cannot parse (empty, cut short, not safetensors at
    all) is a CorruptCheckpoint like a torn .pt, not a crash with the library's own message."""
    try:
        return load_file(path)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CorruptCheckpoint(Path(path).name, None, f"empty or corrupt weights file {path} ({reason})") from e


IMPLAUSIBLE_WEIGHT = 1e6
"""A finite model weight above this came in corrupt: AdamW moves a weight by about lr a step, so training reaches
it only after ~1e9 steps at lr 1e-3, while a flipped top exponent bit turns 0.02 into ~7e36 (inject_fault), which
a non-finite scan does not see. fp16 itself stops at 65504."""


def readable(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, fp8 values through fp32 (an fp8-stored base, sweep/run/fp8_storage.py): torch has no
    isfinite or max for fp8."""
    t = t.detach()
    return t.float() if t.is_floating_point() and t.element_size() == 1 else t


def _scan(file: str, tensors: dict[str, torch.Tensor], weights: bool) -> None:
    """Refuse non-finite values in any tensor, and (model `weights`) values beyond IMPLAUSIBLE_WEIGHT: a bare file
    has no manifest, so this is all that can catch a flipped bit in it."""
    for name, t in tensors.items():
        if not t.is_floating_point():
            continue
        t = readable(t)
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise CorruptCheckpoint(file, name, f"tensor {name} holds {bad} non-finite value(s)")
        amax = float(t.abs().max()) if weights and t.numel() else 0.0
        if amax > IMPLAUSIBLE_WEIGHT:
            raise CorruptCheckpoint(
                file, name, f"tensor {name} holds {amax:.3g}, beyond any trained weight (|w| > {IMPLAUSIBLE_WEIGHT:g})"
            )


# ---- saving ------------------------------------------------------------------------------------------


@dataclass
class State:
    """What a checkpoint holds, in memory: the tensors of its three safetensors files and trainer.json's numbers."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    trainer: dict[str, torch.Tensor]
    numbers: dict

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.model, self.optimizer, self.trainer) for t in d.values())


def state_of(parts, next_step: int, copy: bool = False) -> State:
    """The state of `parts` (sweep.run.build.RunParts) that resumes at `next_step`; `copy`: tensors of its own,
    which later steps of the run cannot change (else views of the run's own tensors where they are on the CPU)."""

    def own(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous().cpu()
        return t.clone() if copy else t

    model, opt = parts.model, parts.optimizer
    names = {p: n for n, p in model.named_parameters()}
    optim, seen = {}, set()
    for p, state in opt.state.items():
        for k, v in state.items():
            if torch.is_tensor(v):
                t = own(v)  # bitsandbytes shares one quantisation map between weights: safetensors wants copies
                optim[f"{names[p]}.{k}"] = t.clone() if t.data_ptr() in seen else t
                seen.add(t.data_ptr())
    monitor_numbers, monitor_tensors = parts.monitor.state_dict()
    trainer = {"rng.noise": parts.noise_gen.get_state(), "rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        trainer.update({f"rng.cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    trainer.update({f"monitor.{k}": own(v) for k, v in monitor_tensors.items()})
    numbers = {
        "next_step": next_step,
        "device": parts.device.type,  # the RNG states above continue only on this device type (device_mismatch)
        "scaler": parts.scaler.state_dict(),
        "monitor": json.loads(json.dumps(monitor_numbers)),  # a copy, as trainer.json will read back
    }
    host = optimizers.host_state(opt)  # a library optimizer's step counts and per-group sums (Prodigy's d)
    if host:
        numbers["optimizer"] = json.loads(json.dumps(host))
    return State({k: own(v) for k, v in model.state_dict().items()}, optim, trainer, numbers)


def save(directory: Path, parts, next_step: int) -> Path:
    """Write a complete checkpoint of `parts` (sweep.run.build.RunParts) that resumes at `next_step`."""
    return write(directory, state_of(parts, next_step))


def write(directory: Path, state: State) -> Path:
    """Write `state` as a checkpoint directory (a temporary name, renamed when complete)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state.model, tmp / MODEL_FILE)
    save_file(state.optimizer, tmp / OPTIM_FILE)
    save_file(state.trainer, tmp / TRAINER_FILE)
    (tmp / TRAINER_JSON).write_text(json.dumps(state.numbers, indent=2))
    files = {}
    for f in (MODEL_FILE, OPTIM_FILE, TRAINER_FILE, TRAINER_JSON):
        entry = {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size}
        if f.endswith(".safetensors"):
            entry["tensors"] = tensor_digests(tmp / f)
        files[f] = entry
    step = state.numbers["next_step"]
    (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=2))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


# ---- verifying and loading ---------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CorruptCheckpoint(MANIFEST, None, f"no {MANIFEST} in {directory}: nothing to verify against")
    try:
        manifest = json.loads(path.read_text())
        assert manifest["format"] == FORMAT and isinstance(manifest["files"], dict)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise CorruptCheckpoint(MANIFEST, None, f"unreadable manifest ({type(e).__name__})") from e
    return manifest


def check_entry(name: str, entry) -> None:
    """A manifest entry must give the file's size and SHA-256: without them there is nothing to verify
    against (a hand-edited or foreign manifest), which is as untrustworthy as a wrong sum."""
    if not isinstance(entry, dict):
        raise CorruptCheckpoint(name, None, f"its {MANIFEST} entry is not an object")
    size, digest = entry.get("bytes"), entry.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool):
        raise CorruptCheckpoint(name, None, f"its {MANIFEST} entry has no 'bytes' (the file size) to verify against")
    if not isinstance(digest, str):
        raise CorruptCheckpoint(name, None, f"its {MANIFEST} entry has no 'sha256' to verify against")


def verify_file(directory: Path, name: str, entry: dict) -> None:
    """Size and SHA-256 against the manifest; on a mismatch, the tensor whose bytes changed."""
    path = Path(directory) / name
    if not path.is_file():
        raise CorruptCheckpoint(name, None, "listed in the manifest but missing")
    check_entry(name, entry)
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CorruptCheckpoint(name, None, f"{size} bytes, the manifest says {entry['bytes']} (truncated or padded)")
    if sha256_file(path) == entry["sha256"]:
        return
    tensors = entry.get("tensors") if isinstance(entry.get("tensors"), dict) else {}
    for tensor, digest in tensor_digests(path).items():
        if tensors.get(tensor) != digest:
            raise CorruptCheckpoint(
                name, tensor, f"SHA-256 mismatch in tensor {tensor} (the file changed since it was saved)"
            )
    raise CorruptCheckpoint(name, None, "SHA-256 mismatch in the file header")


def load_checked(directory: Path, name: str, verify: bool, manifest: dict | None) -> dict[str, torch.Tensor]:
    """One safetensors file of a checkpoint, verified against the manifest and scanned when asked."""
    if verify:
        if name not in manifest["files"]:
            raise CorruptCheckpoint(name, None, f"not listed in {MANIFEST}")
        verify_file(directory, name, manifest["files"][name])
    tensors = load_safetensors(Path(directory) / name)
    if verify:
        _scan(name, tensors, weights=name == MODEL_FILE)
    return tensors


def load_weights(path: Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """A state dict from a checkpoint directory, or from a .safetensors / .pt weights file.

    A lone weights file is verified against a manifest beside it when there is one that lists it,
    and is always scanned for non-finite values (when verify).
    """
    path = Path(path)
    if path.is_dir():
        return load_checked(path, MODEL_FILE, verify, read_manifest(path) if verify else None)
    if not path.is_file():
        raise FileNotFoundError(f"model.init_from: no such file or directory: {path}")
    if path.suffix not in WEIGHT_SUFFIXES:
        raise ValueError(
            f"model.init_from: {path.name} is not a checkpoint directory or a {'/'.join(WEIGHT_SUFFIXES)} file"
        )
    if verify and (path.parent / MANIFEST).is_file():
        manifest = read_manifest(path.parent)
        if path.name in manifest["files"]:
            verify_file(path.parent, path.name, manifest["files"][path.name])
    if path.suffix == ".safetensors":
        tensors = load_safetensors(path)
    else:
        try:  # weights_only: tensors and plain containers, never arbitrary pickled objects
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            said = str(e).strip().splitlines()  # torch's EOFError on an empty file says nothing
            detail = f"not loadable as weights only: {type(e).__name__}: {said[0]}" if said else None
            raise CorruptCheckpoint(
                path.name, None, detail or f"empty or corrupt weights file {path} ({type(e).__name__})"
            ) from e
        tensors = tensors.get("state_dict", tensors) if isinstance(tensors, dict) else tensors
        if not isinstance(tensors, dict) or not all(torch.is_tensor(v) for v in tensors.values()):
            raise CorruptCheckpoint(path.name, None, "not a flat state dict of tensors")
    if verify:
        _scan(path.name, tensors, weights=True)
    return tensors


def load_model_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy a state dict into the model, keeping the model's dtypes; a mismatch is a plain error."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not fit this model: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            " (was it saved by another model or size?)"
        )


# The size in bytes of a diffusion-noise generator's state, per device type: how the device that wrote a
# checkpoint is told for checkpoints saved before trainer.json named it.
_NOISE_STATE_BYTES = {5056: "cpu", 16: "cuda"}


def saved_device(trainer: dict[str, torch.Tensor], numbers: dict) -> str | None:
    """The device type whose run wrote a checkpoint: trainer.json's `device`, else told from the size of its
    noise-generator state (older checkpoints); None when neither says."""
    device = numbers.get("device")
    if isinstance(device, str):
        return device
    noise = trainer.get("rng.noise")
    return _NOISE_STATE_BYTES.get(noise.numel()) if noise is not None else None


def device_mismatch(directory: Path, saved: str | None, device: torch.device) -> str | None:
    """Why a checkpoint written on another device type cannot be resumed on `device`, in one line; None if it can."""
    if saved is None or saved == device.type:
        return None
    return (
        f"checkpoint.resume_from: {directory} was saved by a run on {saved} and this run is on {device.type}: its"
        f" RNG states (diffusion noise, {saved}) continue only on {saved}, so the resumed losses would not be the"
        f" uninterrupted run's. Resume it with device={saved}, or start from its weights alone with"
        f" model.init_from={directory} (fresh optimizer, scaler and RNG)"
    )


def load_optimizer(parts, optim: dict[str, torch.Tensor], host: dict) -> None:
    """Put a checkpoint's optimizer state (`optim`: "<param name>.<key>" -> tensor; `host`: its host-side values,
    sweep.run.optimizers.host_state) into the run's optimizer. A library optimizer takes its state as saved
    (bitsandbytes' uint8 codes stay uint8). Our AdamW takes exp_avg and exp_avg_sq in the weight's dtype, or an
    8-bit AdamW's moments dequantised (the diagnosis's "AdamW in fp32 state" row: the same moments from here on,
    held in fp32)."""
    library = isinstance(parts.optimizer, optimizers.LibraryOptimizer)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in optim.items():
        name, _, k = key.rpartition(".")
        by_param.setdefault(name, {})[k] = tensor
    index = {p: i for i, p in enumerate(optimizers.weights(parts.optimizer))}
    for name, p in parts.model.named_parameters():
        saved = by_param.get(name, {})
        if library or not saved:
            state = {k: v.to(p.device) for k, v in saved.items()}
        else:
            if "state1" in saved:  # bitsandbytes' AdamW8bit: the same algorithm, its moments in 8 bits
                count = host.get("weights", {}).get(str(index.get(p)), {}).get("step", 0)
                saved = optimizers.adamw_state_from_8bit(saved, count)
            # The moments take the weight's dtype: a run resumed under another precision policy (the fp32
            # counterfactual of a pure bf16 run, sweep/diagnose) keeps AdamW's state in the dtype it updates in.
            state = {
                k: saved[k].to(p.device, p.dtype if k != "step" else None)
                for k in ("step", "exp_avg", "exp_avg_sq")
                if k in saved
            }
        if state:
            parts.optimizer.state[p] = state
    parts.optimizer.state_set()
    optimizers.set_host_state(parts.optimizer, host)


def resume(parts, directory: Path, verify: bool = True, optimizer: bool = True) -> int:
    """Restore model, optimizer, scaler, monitor and RNG states from a checkpoint; return the step to run next.

    optimizer=False leaves AdamW's state empty: its moments (and bias correction) start afresh.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint.resume_from: no such checkpoint directory: {directory}")
    manifest = read_manifest(directory) if verify else None
    load_model_weights(parts.model, load_checked(directory, MODEL_FILE, verify, manifest), str(directory))
    optim = load_checked(directory, OPTIM_FILE, verify, manifest) if optimizer else {}
    trainer = load_checked(directory, TRAINER_FILE, verify, manifest)
    if verify:
        verify_file(directory, TRAINER_JSON, manifest["files"].get(TRAINER_JSON, {"bytes": -1}))
    numbers = json.loads((directory / TRAINER_JSON).read_text())
    mismatch = device_mismatch(directory, saved_device(trainer, numbers), parts.device)
    if mismatch:
        raise ValueError(mismatch)
    load_optimizer(parts, optim, numbers.get("optimizer", {}))
    parts.noise_gen.set_state(trainer["rng.noise"])
    torch.set_rng_state(trainer["rng.torch"])
    cuda = [trainer[k] for k in sorted(trainer) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if not parts.scaler.load_state_dict(numbers["scaler"]):
        log.warning(
            "checkpoint.resume_from: %s was saved by a run without loss scaling; the loss scale starts at"
            " this run's precision.scaler.init_scale %s, not the saved 1.0",
            directory,
            parts.scaler.scale_of(),
        )
    snapshot = {k.removeprefix("monitor."): v.to(parts.device) for k, v in trainer.items() if k.startswith("monitor.")}
    parts.monitor.load_state_dict(numbers["monitor"], snapshot)
    return int(numbers["next_step"])


# ---- fault injection (the Hallo scenario) ------------------------------------------------------------

# Per dtype: (element size, NaN bit pattern, the top exponent bit) in the little-endian element.
_DTYPE_BITS = {"F32": (4, 0x7FC00000, 1 << 30), "F16": (2, 0x7E00, 1 << 14), "BF16": (2, 0x7FC0, 1 << 14)}


def inject_fault(source: Path, dest: Path, kind: str, tensor: str | None) -> tuple[Path, str]:
    """Copy a checkpoint directory or weights file to dest and corrupt one element of one tensor in the copy.

    kind "nan" writes a NaN (a non-finite scan finds it); "bitflip" flips the top exponent bit of an
    element below 1 in magnitude, so 0.02 becomes ~7e36: finite, invisible to a NaN scan, found only by
    the checksum. Returns (the path to load instead, the tensor corrupted). Of a directory, only the weights
    file is copied (it is the one written); the others, read only, are hard links to the source's where the file
    system allows one (`_link_or_copy`): the optimizer's and trainer's state are ~3/4 of a checkpoint, and a run
    and each of its diagnosis's trials make their own copy.
    """
    source, dest = Path(source), Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    if source.is_dir():
        top = os.fspath(source)
        weights_left_out = lambda folder, names: {MODEL_FILE} if folder == top else set()  # noqa: E731
        shutil.copytree(source, dest, copy_function=_link_or_copy, ignore=weights_left_out)
        target = dest / MODEL_FILE
        shutil.copy2(source / MODEL_FILE, target)  # a file of its own: the write below must never reach the source
    else:
        dest.mkdir(parents=True)
        shutil.copy2(source, dest / source.name)
        target = dest / source.name
        if (source.parent / MANIFEST).is_file():
            shutil.copy2(source.parent / MANIFEST, dest / MANIFEST)
    if target.suffix != ".safetensors":
        raise ValueError(f"checkpoint.inject needs a safetensors file, got {target.name}")
    spans = tensor_spans(target)
    floats = [n for n, s in spans.items() if s.dtype in _DTYPE_BITS and s.end > s.start]
    name = tensor or next((n for n in floats if n.endswith("attn.qkv.weight")), floats[0] if floats else None)
    if name not in spans or name not in floats:
        raise ValueError(f"checkpoint.inject_tensor: no floating tensor {name!r} in {target.name}")
    span = spans[name]
    size, nan_bits, top_exponent = _DTYPE_BITS[span.dtype]
    raw = bytearray(target.read_bytes())
    values = load_file(target)[name].reshape(-1)
    small = (values.float().abs() < 1).nonzero()
    at = span.start + size * (int(small[0]) if len(small) else 0)
    bits = int.from_bytes(raw[at : at + size], "little")
    bits = nan_bits if kind == "nan" else bits ^ top_exponent
    raw[at : at + size] = bits.to_bytes(size, "little")
    target.write_bytes(bytes(raw))
    return (dest if source.is_dir() else target), name


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link to src at dst, or a copy where the file system refuses one (another device, no link support)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


class CheckpointHook:
    """A sweep.run.train.StepHook: saves every `every` steps into <run dir>/checkpoints, keeps the newest `keep`."""

    def __init__(self, run_dir: Path, every: int, keep: int = 0) -> None:
        self.root, self.every, self.keep = Path(run_dir) / "checkpoints", every, keep
        self.saved: list[Path] = []

    def after_step(self, step: int, loss: float, parts) -> bool:
        if (step + 1) % self.every == 0:
            self.saved.append(save(self.root / f"step_{step + 1:06d}", parts, step + 1))
            while self.keep and len(self.saved) > self.keep:
                shutil.rmtree(self.saved.pop(0), ignore_errors=True)
        return False
