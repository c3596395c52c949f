"""`python -m sweep.coord_check`: under µP each layer's activation RMS stays flat from width 32 to 256 after a
few AdamW steps, under SP the output and timestep layers grow; bad arguments are one line, exit 2.

Thresholds, set from what the check measured (video_dit, 2 blocks, 4 steps at lr 1e-2, seed 0, widths
32..256; 2-core CPU, torch 2.13, 2026-11-25), with margin:
- µP: max/min over widths of every layer's RMS at the last step measured <= 1.22 (t_embedder; the rest
  <= 1.06), |slope| <= 0.071: the test asks max/min <= 1.5 and |slope| <= 0.15.
- SP: final_layer max/min 5.88 (slope +0.90), t_embedder 3.96 (slope +0.68): the test asks max/min >= 3
  for both and a slope >= 0.5 for the final layer.
"""

from __future__ import annotations

import pytest

from sweep.coord_check import Setup, main, run, slopes, spread

from .conftest import run_cli


@pytest.fixture(scope="module")
def results():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs it (--threads 1): ~2 s here, far more when 2 threads contend
    try:
        yield run(Setup(widths=(32, 64, 128, 256), depth=2, steps=4, lr=1e-2, seed=0))
    finally:
        torch.set_num_threads(threads)


def test_mup_is_flat_across_width(results):
    mup, last = results["mup"], 3
    for layer, slope in slopes(mup, last).items():
        assert spread(mup, layer, last) <= 1.5, layer
        assert abs(slope) <= 0.15, (layer, slope)


def test_sp_grows_with_width(results):
    sp, last = results["sp"], 3
    assert spread(sp, "final_layer", last) >= 3
    assert spread(sp, "t_embedder", last) >= 3
    assert slopes(sp, last)["final_layer"] >= 0.5


def test_fixed_seeds_give_the_same_numbers(results):
    again = run(Setup(widths=(32, 64), depth=2, steps=4, lr=1e-2, seed=0, params=("mup",)))
    assert again["mup"][64] == results["mup"][64]


@pytest.mark.parametrize(
    "argv,word",
    [
        (["--widths", "64"], "--widths"),  # one width: no slope
        (["--widths", "32,48"], "--widths"),  # 48 is no multiple of the head dim 32
        (["--widths", "32,x"], "--widths"),
        (["--steps", "0"], "--steps"),
        (["--lr", "-1"], "--lr"),
        (["--base-width", "64"], "--base-width"),  # above the smallest width
        (["--params", "ntk"], "--params"),
        (["--nope"], "unrecognized"),
        (["--depth", "100000"], "--widths/--depth: width 256 at depth 100000 would have ~"),  # built for minutes
        (["--widths", "32,65536"], "over the 1,000M limit"),  # then out of memory
        (["--seed", "-1"], "--seed: must be in [0, 4294967295]"),  # was taken
        (["--seed", "99999999999999999999"], "--seed: must be in [0, 4294967295]"),  # a traceback
        (["--threads", "100000"], "--threads: must be in [0, 1024]"),  # segfaulted torch (rc 139)
        (["--html", "/"], "--html: / is a folder"),  # IsADirectoryError after the runs
        (["--html", "/no/such/folder/c.html"], "--html: no folder /no/such/folder"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(argv, word, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coord_check: ") and word in err[0], err


def test_cli_writes_table_and_html(tmp_path, capsys):
    html = tmp_path / "cc.html"
    assert main(["--widths", "32,64", "--steps", "2", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "== mup:" in out and "slope of log RMS vs log width at step 1" in out
    assert "plotly" in html.read_text() and "python -m sweep.coord_check --widths 32,64" in html.read_text()


def test_help_shows_the_command():
    proc = run_cli("-m", "sweep.coord_check", "--help")
    assert proc.returncode == 0 and "python -m sweep.coord_check --add-512" in proc.stdout
