"""The confirmation at a longer horizon: a sweep's answer rerun at `confirm.steps` (4x its steps by default).

A setting stable in every seed at N steps can still spike later (bf16_amp at lr 3e-2 was stable in 2/2 seeds at
50 steps and spiked at step 74 of 200). After a multirun (confirm.mode=auto) or by hand (`python -m sweep.confirm
SWEEP_DIR`), the recommended setting and each combination's largest stable lr are rerun to the longer horizon,
every seed; where one fails, the next lower stable lr of its combination. The record, confirmation.json, is what
the frontier's `held` column and the recommendation read (sweep/report/confirmation.py).

- plan.py       which settings: recommended, largest stable lr per combination, the step down from a failure
- state.py      the grid runs' final states, kept in memory so that a confirmation continues them
- trial.py      one setting's seeds at the longer horizon: continued, packed from step 0 on a GPU, or from step 0
- record.py     confirmation.json, written whole after every seed, read back by a resume
- multirun.py   the confirmation of a sweep within its budget (confirm_sweep)
- __main__.py   python -m sweep.confirm
"""
