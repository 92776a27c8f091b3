"""Third-party warnings that tell a user nothing, filtered once, each by its exact message and source.

Each is raised inside another library, on every training step, about a call the user did not make; together they
were 3,774 of the 3,813 lines the README's main command printed under ZeRO-3 (they repeat because code that uses
``warnings.catch_warnings`` resets Python's once-per-location memory). Every other warning, including these
libraries' other ones, is left as it is: no global ``ignore``.
"""

import functools
import logging
import warnings

# (message regex, category, module that raises it, why it says nothing to a user)
KNOWN = (
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed", "DeepSpeed's ZeRO-3 calls them each step (torch 2.13 renamed them)"),
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils",
     "TRL reads the property around every reference or generation pass (transformers 5.23 renamed it)"),
    (r"`gradient_checkpointing_(enable|disable)` is deprecated", FutureWarning, r"transformers\.modeling_utils",
     "TRL toggles checkpointing around every generation (transformers 5.23 renamed the methods)"),
    (r"`gradient_checkpointing(_kwargs)?` is deprecated", FutureWarning, r"transformers\.training_args",
     "TRL's configs set the old name by default, in every process (transformers 5.23 renamed it; older releases "
     "lack the new name, so a config cannot use it and still run on them)"),
)


@functools.cache
def quiet_known_noise() -> None:
    """Filter the warnings in ``KNOWN`` for this process (once; the filters match nothing else)."""
    for message, category, module, _ in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


# (logger, message prefix, why it says nothing to a user)
KNOWN_LOGS = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community",
     "logged at import on CPUs with AVX512-BF16 when the optional `kernels` package is absent; bitsandbytes then uses "
     "its own CPU kernel, and trl_ext keeps 4-bit layers off that packed path anyway (engines/quantization.py)"),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@functools.cache
def quiet_known_logs() -> None:
    """Drop the log records in ``KNOWN_LOGS`` (once; before the library that logs them is imported)."""
    for name, prefix, _ in KNOWN_LOGS:
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
