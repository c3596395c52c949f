"""Differential diagnosis of a diverged run: its mechanism, a counterfactual table, and a fix a real run confirms.

    python -m sweep.diagnose RUN_DIR              # mechanism, counterfactuals, fix -> RUN_DIR/diagnosis.json
    python -m sweep.diagnose RUN_DIR --bisect     # + the minimal set of modules that must stay in fp32

record.py reads the run; mechanism.py decides the mechanism from its recorded signals; counterfactual.py
replays it to its last healthy step and runs the bad steps with one change at a time; bisect.py searches
the modules that must compute in fp32; fix.py runs the proposed overrides from step 0; diagnosis.py puts
them together and writes diagnosis.json (docs/design.md, "Diagnosis").
"""
