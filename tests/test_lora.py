"""finetune=lora: a tiny CogVideoX trained by one run is fine-tuned by others (model.init_from), with peft
adapters on a frozen base, over a sweep of optim.lora_lr: only the adapters move, and by the lr asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sweep.run.build import build_parts
from sweep.run.execute import execute
from sweep.run.finetune import is_adapter
from sweep.run.precision import PrecisionPolicy

from .conftest import make_run

BASE = ["model=cogvideox_tiny", "data.batch_size=2", "threads=1"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """An earlier run of the same tiny model that saved its weights: the 'pretrained checkpoint'."""
    out = tmp_path_factory.mktemp("pretrain")
    r = execute(make_run(*BASE, "steps=2", "checkpoint.every=2"), out, {})
    assert r.status == "stable", r.reason
    return out / "checkpoints" / "step_000002"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))[-1:]
    return load_file(ckpt / "model.safetensors")


def test_lora_sweep_over_lora_lr_moves_only_the_adapters(pretrained, tmp_path):
    init = load_file(pretrained / "model.safetensors")
    adapters = {}
    for lora_lr in (1e-3, 1e-2):
        run_dir = tmp_path / f"lora_lr={lora_lr}"
        r = execute(
            make_run(
                *BASE,
                "finetune=lora",
                "finetune.rank=2",
                f"optim.lora_lr={lora_lr}",
                "steps=3",
                "checkpoint.every=3",
                f"model.init_from={pretrained}",
            ),
            run_dir,
            {},
        )
        assert r.status == "stable", r.reason
        final = final_weights(run_dir)
        base = {k.replace(".base_layer.", "."): v for k, v in final.items() if not is_adapter(k)}
        assert base.keys() == init.keys()  # every pretrained weight is there, under peft's base_layer name
        for k, v in base.items():
            assert torch.equal(v, init[k]), f"frozen base weight {k} changed"
        lora = {k: v for k, v in final.items() if is_adapter(k)}
        assert any(".to_q.lora_B." in k for k in lora) and any(".to_out.0.lora_A." in k for k in lora)
        assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # B starts at 0: it trained
        adapters[lora_lr] = lora
    # lr was really the adapters' own: 10x the lr moves B (from 0) roughly 10x further in 3 Adam steps.
    move = {lr: sum(v.abs().sum() for k, v in a.items() if ".lora_B." in k) for lr, a in adapters.items()}
    assert 5 < move[1e-2] / move[1e-3] < 15


def test_adapters_get_their_own_param_group_and_the_base_its_lr_when_trained(pretrained):
    run = make_run(
        *BASE,
        "finetune=lora",
        "optim.lr=1e-4",
        "optim.lora_lr=1e-2",
        "finetune.train_base=true",
        f"model.init_from={pretrained}",
    )
    parts = build_parts(run, torch.device("cpu"), PrecisionPolicy.from_config(run.precision))
    groups = {g["name"]: g for g in parts.optimizer.param_groups}
    assert groups["base"]["lr"] == 1e-4 and groups["lora"]["lr"] == 1e-2 and groups["lora"]["lr_scale"] == 100
    names = {id(p): n for n, p in parts.model.named_parameters()}
    assert all(is_adapter(names[id(p)]) for p in groups["lora"]["params"])
    frozen = make_run(*BASE, "finetune=lora", f"model.init_from={pretrained}")
    parts = build_parts(frozen, torch.device("cpu"), PrecisionPolicy.from_config(frozen.precision))
    assert [g["name"] for g in parts.optimizer.param_groups] == ["lora"]
    trainable = [n for n, p in parts.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)


def test_lora_without_pretrained_weights_is_warned_about(caplog):
    """Adapters on weights never trained get no gradient behind a DiT's zero gates: every lr stalls at the first
    stall check (the diagnosis calls those zeros 'unexplained', not an underflow). Said at the start of the run."""
    from models import build_model
    from sweep.run.finetune import apply_finetune

    def tiny():
        return build_model("video_dit", "tiny", input_size=8, in_channels=3, num_frames=4)

    with caplog.at_level("WARNING", logger="sweep"):
        apply_finetune(make_run("finetune=lora"), tiny(), torch.float32)
    assert any("finetune=lora without model.init_from" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sweep"):
        apply_finetune(make_run("finetune=lora", "finetune.train_base=true"), tiny(), torch.float32)
    assert not caplog.records


def test_the_untrained_eval_loss_rebuilds_the_same_weights_without_a_second_warning(caplog):
    """no_progress's untrained eval loss (sweep/run/execute.py) builds the run's weights again: the same weights as
    the run's first step saw (its eval loss before training, bit for bit), and the LoRA warning not said twice."""
    from sweep.run.build import reset_process_state
    from sweep.run.evaluate import make_evaluator
    from sweep.run.execute import untrained_eval_loss

    run = make_run(*BASE, "finetune=lora", "steps=2")
    policy = PrecisionPolicy.from_config(run.precision, torch.device("cpu"))
    with caplog.at_level("WARNING", logger="sweep"):
        reset_process_state(run, policy)  # as execute does before a run's build
        parts = build_parts(run, torch.device("cpu"), policy)
        evaluator = make_evaluator(run, parts)
        before = evaluator(parts.model, -1)
        assert untrained_eval_loss(run, parts, evaluator) == before
    warned = [r for r in caplog.records if "finetune=lora without model.init_from" in r.message]
    assert len(warned) == 1
