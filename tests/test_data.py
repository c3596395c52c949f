"""Tests for sweep.data (synthetic, batches, checks): determinism, content, faults, batch order, batch checks."""

from __future__ import annotations

import math

import pytest
import torch

from sweep.data.batches import BatchOrder, load_batch, load_checked_batch
from sweep.data.checks import BatchIssue, check_batch
from sweep.data.synthetic import Fault, SyntheticClips

SHAPE = dict(frames=8, channels=3, height=16, width=16)


def _all(ds: SyntheticClips) -> torch.Tensor:
    """Every clip of ds stacked as (N, C, F, H, W)."""
    return load_batch(ds, range(len(ds)))


def test_same_seed_is_bit_identical_and_seed_matters() -> None:
    a = _all(SyntheticClips(32, seed=7, **SHAPE))
    b = _all(SyntheticClips(32, seed=7, **SHAPE))
    c = _all(SyntheticClips(32, seed=8, **SHAPE))
    assert torch.equal(a, b)
    assert (a - c).abs().amax() > 0.5


def test_sample_is_a_pure_function_of_seed_and_index() -> None:
    # Replay regenerates one sample without the rest: dataset size and global RNG don't matter.
    big = SyntheticClips(200, seed=3, **SHAPE)
    torch.manual_seed(123)
    small = SyntheticClips(38, seed=3, **SHAPE)
    assert torch.equal(big.clip(37), small.clip(37))
    assert torch.equal(big[5], small[5])


def test_clip_returns_a_copy() -> None:
    ds = SyntheticClips(4, seed=0, **SHAPE)
    ds.clip(1).fill_(100.0)
    assert ds.clip(1).abs().amax() < 1


def test_values_strictly_inside_unit_range_and_not_degenerate() -> None:
    x = _all(SyntheticClips(128, seed=0, **SHAPE))
    assert x.dtype == torch.float32
    assert x.isfinite().all()
    assert x.abs().amax() < 1.0
    assert 0.2 < x.std() < 0.7
    assert x.amin() < -0.5 and x.amax() > 0.5  # uses most of the range


def test_temporal_structure_consecutive_frames_correlate_and_shapes_move() -> None:
    x = _all(SyntheticClips(64, seed=1, **SHAPE))
    frames = x.permute(0, 2, 1, 3, 4).flatten(2)  # (N, F, C*H*W)
    frames = frames - frames.mean(-1, keepdim=True)
    frames = frames / frames.norm(dim=-1, keepdim=True)
    within = (frames[:, 1:] * frames[:, :-1]).sum(-1).mean()
    across = (frames[1:, 0] * frames[:-1, 0]).sum(-1).abs().mean()
    assert within > 0.6
    assert within > 3 * across
    # Frames are not copies of one another: every clip changes between consecutive frames.
    step_change = (x[:, :, 1:] - x[:, :, :-1]).abs().flatten(1).amax(1)
    assert (step_change > 0.1).all()


def test_spatial_structure_neighbouring_pixels_correlate() -> None:
    x = _all(SyntheticClips(64, seed=2, **SHAPE))
    # Correlate horizontal neighbours within each (clip, channel, frame) image, so differing
    # base colours between clips cannot fake structure; i.i.d. noise would give ~0.
    a, b = x[..., :, :-1].flatten(3), x[..., :, 1:].flatten(3)
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    corr = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    assert corr.mean() > 0.75


def test_background_drifts() -> None:
    # Shapes cover a minority of pixels; most pixels change only because the grating drifts.
    x = _all(SyntheticClips(64, seed=2, **SHAPE))
    changed = (x[:, :, 1:] - x[:, :, :-1]).abs() > 0.01
    assert changed.float().mean() > 0.5


def test_samples_are_distinct() -> None:
    x = _all(SyntheticClips(64, seed=0, **SHAPE)).flatten(1)
    gaps = torch.cdist(x, x) + torch.eye(64) * 1e9
    assert gaps.amin() > 1.0


def test_shapes_video_and_image_modes() -> None:
    video = SyntheticClips(5, seed=0, **SHAPE)
    assert video[2].shape == (3, 8, 16, 16)
    assert load_batch(video, [0, 4, 4]).shape == (3, 3, 8, 16, 16)
    images = SyntheticClips(5, frames=1, channels=4, height=8, width=12, seed=0, as_images=True)
    assert images[2].shape == (4, 8, 12)
    assert torch.equal(images.image(2), images.clip(2)[:, 0])
    assert load_batch(images, [1, 2]).shape == (2, 4, 8, 12)
    with pytest.raises(ValueError):
        SyntheticClips(5, seed=0, as_images=True, **SHAPE)
    with pytest.raises(ValueError):
        video.image(0)
    with pytest.raises(IndexError):
        video.clip(5)


@pytest.mark.parametrize("kind", ["nan", "inf", "range"])
def test_fault_appears_exactly_at_its_index(kind: str) -> None:
    clean = _all(SyntheticClips(16, seed=4, **SHAPE))
    faulty = _all(SyntheticClips(16, seed=4, faults=[Fault(9, kind)], **SHAPE))
    others = [i for i in range(16) if i != 9]
    assert torch.equal(faulty[others], clean[others])
    bad = faulty[9]
    if kind == "nan":
        assert 0 < bad.isnan().sum() < bad.numel()
        assert not bad.isinf().any()
    elif kind == "inf":
        assert 0 < bad.isinf().sum() < bad.numel()
        assert (bad[bad.isinf()] > 0).all()
    else:
        assert torch.allclose(bad, (clean[9] + 1) * 127.5)
        assert bad.amin() >= 0 and 100 < bad.amax() <= 255
    # Outside the patch a NaN/Inf sample keeps its clean content.
    keep = bad.isfinite()
    if kind != "range":
        assert torch.equal(bad[keep], clean[9][keep])


def test_fault_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        Fault(0, "zero")
    with pytest.raises(ValueError, match="index"):
        SyntheticClips(4, seed=0, faults=[Fault(4, "nan")], **SHAPE)
    with pytest.raises(ValueError, match="index"):
        SyntheticClips(4, seed=0, faults=[Fault(-1, "nan")], **SHAPE)


def _sequential_order(num_samples: int, batch_size: int, seed: int, steps: int) -> list[list[int]]:
    """Reference: walk the concatenated per-epoch permutations batch by batch."""
    order = BatchOrder(num_samples, batch_size, seed)
    stream: list[int] = []
    epoch = 0
    while len(stream) < steps * batch_size:
        # Epoch permutations as BatchOrder reveals them at epoch-aligned positions.
        stream.extend(_epoch_perm(order, epoch))
        epoch += 1
    return [stream[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


def _epoch_perm(order: BatchOrder, epoch: int) -> list[int]:
    """One epoch's permutation, read through a batch-size-1 order with the same seed."""
    one = BatchOrder(order.num_samples, 1, order.seed)
    start = epoch * order.num_samples
    return [one.indices(start + k)[0] for k in range(order.num_samples)]


@pytest.mark.parametrize(("n", "b"), [(10, 4), (10, 5), (7, 16), (32, 32)])
def test_batch_order_matches_sequential_iteration(n: int, b: int) -> None:
    order = BatchOrder(n, b, seed=11)
    steps = 3 * n // b + 3  # crosses several epoch boundaries
    expected = _sequential_order(n, b, 11, steps)
    assert [order.indices(s) for s in range(steps)] == expected
    # Random access (resume) agrees with in-order access, in any order.
    for s in reversed(range(steps)):
        assert BatchOrder(n, b, seed=11).indices(s) == expected[s]


def test_batch_order_is_a_permutation_per_epoch_and_differs_across_epochs_and_seeds() -> None:
    order = BatchOrder(24, 8, seed=5)
    epochs = [sum((order.indices(3 * e + k) for k in range(3)), []) for e in range(4)]
    for perm in epochs:
        assert sorted(perm) == list(range(24))
    assert len({tuple(p) for p in epochs}) == 4
    assert epochs[0] != sum((BatchOrder(24, 8, seed=6).indices(k) for k in range(3)), [])
    assert order.epoch(2) == 0 and order.epoch(3) == 1
    with pytest.raises(ValueError):
        order.indices(-1)


def test_check_batch_clean_is_none() -> None:
    x = _all(SyntheticClips(16, seed=0, **SHAPE))
    assert check_batch(x) is None
    assert check_batch(x.bfloat16()) is None
    assert check_batch(torch.full((2, 3), 1.0005)) is None  # within the tolerance


def test_amax_propagates_nan_on_this_backend() -> None:
    # check_batch's single-reduction fast path relies on this.
    x = torch.zeros(4, 1000)
    x[2, 500] = math.nan
    assert x.abs().amax().isnan()
    x[1, 3] = math.inf
    assert x.abs().amax().isnan()
    assert x.bfloat16().abs().amax().isnan()


@pytest.mark.parametrize("kind", ["nan", "inf", "range"])
def test_check_batch_finds_each_fault_kind(kind: str) -> None:
    ds = SyntheticClips(20, seed=0, faults=[Fault(17, kind)], **SHAPE)
    indices = [3, 17, 5, 8]
    issue = check_batch(load_batch(ds, indices), indices=indices)
    assert isinstance(issue, BatchIssue)
    assert issue.kind == kind
    assert issue.positions == [1]
    assert "sample 17" in issue.detail and "\n" not in issue.detail
    if kind == "nan":
        assert math.isnan(issue.amax) and "48 NaN values" in issue.detail
    elif kind == "inf":
        assert issue.amax == math.inf and "48 Inf values" in issue.detail
        assert "outside" not in issue.detail  # Inf is not double-counted as out of range
    else:
        assert 100 < issue.amax <= 255 and "outside [-1, 1]" in issue.detail
        assert "data.range_limit" not in issue.detail  # named only by the loader, which knows the key
    named = load_checked_batch(ds, indices, 1.001)[1].detail
    assert named.startswith(issue.detail) and ("(data.range_limit=1.001; VAE latents" in named) == (kind == "range")


def test_check_batch_reports_most_severe_kind_and_all_positions() -> None:
    faults = [Fault(2, "range"), Fault(4, "inf"), Fault(6, "nan")]
    ds = SyntheticClips(8, seed=0, faults=faults, **SHAPE)
    issue = check_batch(load_batch(ds, range(8)))
    assert issue is not None and issue.kind == "nan" and issue.positions == [2, 4, 6]
    issue = check_batch(load_batch(ds, [4, 0, 2]))
    assert issue is not None and issue.kind == "inf" and issue.positions == [0, 2]
    assert issue.detail.startswith("position 0:")
    x = torch.zeros(3, 5)
    x[1, 0] = -3.0  # negative overflow counts too
    issue = check_batch(x)
    assert issue is not None and issue.kind == "range" and issue.positions == [1] and issue.amax == 3.0


def test_rendering_is_cached_per_config_and_never_shared(monkeypatch) -> None:
    """Jobs in one process reuse the rendering of identical data, but each dataset owns its copy."""
    import sweep.data.synthetic as data

    data._render_all.cache_clear()
    cold = _all(SyntheticClips(12, seed=3, **SHAPE))
    rendered = []
    monkeypatch.setattr(data, "_render_clip", lambda g, *shape: rendered.append(1) or torch.zeros(*shape))
    a, b = SyntheticClips(12, seed=3, **SHAPE), SyntheticClips(12, seed=3, **SHAPE)
    assert torch.equal(_all(a), cold) and torch.equal(_all(b), cold) and not rendered  # no new rendering
    a._cache()[0].fill_(5.0)  # a dataset's tensor is its own: changing it reaches no other dataset
    assert torch.equal(_all(b), cold) and torch.equal(_all(SyntheticClips(12, seed=3, **SHAPE)), cold)
    # Another seed, size or shape is another rendering, not the cached one.
    for other in (dict(seed=4, **SHAPE), dict(seed=3, frames=4, channels=3, height=16, width=16)):
        n = len(rendered)
        SyntheticClips(12, **other).clip(0)
        assert len(rendered) - n == 12
    SyntheticClips(13, seed=3, **SHAPE).clip(0)
    assert len(rendered) == 12 + 12 + 13


def test_faults_of_one_dataset_never_reach_the_cached_rendering() -> None:
    faulty = _all(SyntheticClips(8, seed=5, faults=[Fault(2, "nan"), Fault(3, "range")], **SHAPE))
    clean = _all(SyntheticClips(8, seed=5, **SHAPE))
    assert faulty[2].isnan().any() and clean.isfinite().all() and clean.abs().amax() < 1
    assert torch.equal(
        _all(SyntheticClips(8, seed=5, faults=[Fault(2, "nan"), Fault(3, "range")], **SHAPE)).nan_to_num(),
        faulty.nan_to_num(),
    )


@pytest.mark.parametrize("as_images", [False, True])
def test_device_batches_are_todays_batches_bit_for_bit(as_images):
    """sweep/data/device.py: the clips on the device and a gather per step give load_batch's stack exactly,
    faults, image mode and a drop_bad Subset included; the device flag says what check_batch says."""
    from torch.utils.data import Subset

    from sweep.data.device import DeviceBatches

    frames = 1 if as_images else 3
    faults = [Fault(2, "nan"), Fault(5, "inf"), Fault(7, "range")]
    clips = SyntheticClips(12, frames, 3, 8, 8, seed=4, faults=faults, as_images=as_images)
    for dataset in (clips, Subset(clips, [0, 1, 2, 4, 5, 7, 9, 11])):
        order = BatchOrder(len(dataset), 3, seed=11)
        batches = DeviceBatches.of(dataset, order, 20, torch.device("cpu"), 1.001)
        flagged = []
        for step in range(20):
            x = load_batch(dataset, order.indices(step))
            got = batches.at(torch.tensor([step]))
            assert got.shape == x.shape and torch.equal(got.nan_to_num(1e9), x.nan_to_num(1e9))
            assert bool(batches.bad(got)) == (check_batch(x, 1.001) is not None)
            flagged.append(bool(batches.bad(got)))
        assert any(flagged) and not all(flagged)


def test_data_read_from_files_has_no_device_batches(tmp_path):
    from sweep.data.batches import BatchOrder
    from sweep.data.device import DeviceBatches

    assert (
        DeviceBatches.of(torch.utils.data.TensorDataset(torch.zeros(4, 2)), BatchOrder(4, 2, 0), 3, "cpu", 1.0) is None
    )


def test_a_packs_batches_are_each_runs_device_batches_bit_for_bit():
    """sweep.data.device.PackBatches: one gather gives every packed run's own batch (its own clips, faults and
    order), runs with the same clips share them, each run's flag is its own check, and compaction keeps rows."""
    from sweep.data.device import DeviceBatches, PackBatches

    faulty = SyntheticClips(12, 3, 3, 8, 8, seed=4, faults=[Fault(2, "nan"), Fault(7, "range")])
    clean, other = SyntheticClips(12, 3, 3, 8, 8, seed=4), SyntheticClips(10, 3, 3, 8, 8, seed=5)
    sets = [clean, faulty, clean, other, faulty]  # run 4 checks nothing: its bad batches raise no flag
    orders = [BatchOrder(len(d), 3, seed=k) for k, d in enumerate(sets)]
    each = [DeviceBatches.of(d, o, 20, torch.device("cpu"), 1.001) for d, o in zip(sets, orders)]
    pack = PackBatches.of(each, [True, True, True, True, False])
    assert pack.clips.shape[0] == 12 + 12 + 10  # clean, faulty, other: each once
    flagged = set()
    for step in range(20):
        clock = torch.tensor([step])
        x = pack.at(clock)
        flags = pack.bad(x).tolist()
        for k, b in enumerate(each):
            assert torch.equal(x[k].nan_to_num(1e9), b.at(clock).nan_to_num(1e9))
            assert flags[k] == (k != 4 and bool(b.bad(b.at(clock))))
            flagged |= {k} if flags[k] else set()
    assert flagged == {1}
    pack.keep([3, 1])
    five = torch.tensor([5])
    assert torch.equal(pack.at(five)[1].nan_to_num(1e9), each[1].at(five).nan_to_num(1e9))
    assert torch.equal(pack.at(five)[0], each[3].at(five)) and pack.checked.tolist() == [True, True]
