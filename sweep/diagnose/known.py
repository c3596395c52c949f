"""Each mechanism's known fix, in words: what diagnosis.json `known_fix` says and what the summary's
recommendation says about a sweep whose failures share a mechanism (sweep/report/failures.py). No torch here:
the report reads it."""

KNOWN = {
    "attention_logit_growth": "qk-layernorm bounds the logits (Wortsman et al. 2023)",
    "adam_second_moment_lag": "update clipping (StableAdamW) or a lower beta2 re-estimates the second moment",
    "activation_overflow": "bf16 has fp32's range; or keep the overflowing modules in fp32",
    "update_underflow": "fp32 master weights (bf16 autocast) keep small updates; a smaller eps where fp32 stalls too",
    "gradient_underflow": "loss scaling (or bf16) keeps small gradients",
    "loss_scale_collapse": "bf16 needs no loss scaling",
    "kernel": "the reference kernel",
    "bad_input": "train without the bad samples (python -m sweep.doctor finds them in a folder)",
    "optimizer_state": "AdamW with fp32 state (optim=adamw), or fp32 state for more tensors (optim.min_8bit_size)",
    "lr_too_high": "a lower lr",
    "nondeterministic": "deterministic=true",
}
"""Mechanism (sweep/diagnose/mechanism.py MECHANISMS) -> its known fix; none for corrupt_checkpoint (diagnosis.py
REFETCH says it) and unexplained."""
