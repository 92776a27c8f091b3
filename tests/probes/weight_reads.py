"""Count the bytes of tensor data each process reads from safetensors files through transformers' loader.

``install()`` wraps the ``safe_open`` that ``transformers.modeling_utils`` calls: every tensor taken from a file
(``get_tensor``, or indexing a ``get_slice``) adds its size to ``READS[file]``. Opening a file to read its header
(names, shapes, dtypes) reads no tensor data and adds nothing.
"""

from collections import Counter

READS: Counter = Counter()


class _Slice:
    def __init__(self, inner, path):
        self._inner, self._path = inner, path

    def __getitem__(self, index):
        tensor = self._inner[index]
        READS[self._path] += tensor.numel() * tensor.element_size()
        return tensor

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _Handle:
    def __init__(self, inner, path):
        self._inner, self._path = inner, path

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def get_tensor(self, name):
        tensor = self._inner.get_tensor(name)
        READS[self._path] += tensor.numel() * tensor.element_size()
        return tensor

    def get_slice(self, name):
        return _Slice(self._inner.get_slice(name), self._path)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def install() -> None:
    """Count from now on, in this process (idempotent)."""
    from transformers import modeling_utils

    if getattr(modeling_utils.safe_open, "counts_reads", False):
        return
    original = modeling_utils.safe_open

    def counting_safe_open(filename, *args, **kwargs):
        return _Handle(original(filename, *args, **kwargs), str(filename))

    counting_safe_open.counts_reads = True
    modeling_utils.safe_open = counting_safe_open
