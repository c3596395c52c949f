"""The precision-sweep runner (python -m sweep). Importing it quiets library warnings at import time that are not
about the user's run and would break its one-line error messages (`NOISY_LOGGERS`, `_SkipExtensionLoads`)."""

import logging

NOISY_LOGGERS = (
    "torch.utils._pytree",  # torchao 0.18 registers its Enums with pytree: a deprecation warning per Enum, per process
    "diffusers.quantizers.torchao.torchao_quantizer",  # diffusers probes torchao's tensor types it has no use for here
    "bitsandbytes.backends.cpu.ops",  # its optional 4-bit CPU GEMM package ("kernels"): not used by 8-bit state
    "torchao.kernel.intmm",  # "Detected no triton": its int8 matmuls, which nothing here runs
)
"""Loggers set to ERROR: what they warn about at import does not concern a sweep (docs/fp8.md)."""


class _SkipExtensionLoads(logging.Filter):
    """torchao's "Failed to load .../torchao/_C_mxfp8...so" (and _C_cutlass_90a): its compiled MXFP8 and CUTLASS
    kernels, absent from a CPU build and used by no recipe here (sweep/run/fp8.py runs torch._scaled_mm)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load ") and "/torchao/_C_" in message)


for _name in NOISY_LOGGERS:
    logging.getLogger(_name).setLevel(logging.ERROR)
logging.getLogger("torchao").addFilter(_SkipExtensionLoads())
