"""Import FFCV 1.0.2 once, undoing its process-wide side effects.

FFCV is dormant; two of its habits would hurt a trainer that shares the process with it:

- ``ffcv.pipeline.compiler`` calls ``torch.set_num_threads(1)`` when it is imported, and every
  ``Loader`` calls ``torch.set_num_threads(num_workers)`` at construction and at the start of every
  epoch (``Compiler.set_num_threads``). On a CPU run that silently caps the model's own threads.
  We keep torch's thread count as it was and let ``Compiler.set_num_threads`` set only numba's
  (thread-local) pool, clamped to what numba has (FFCV would raise for more workers than cores).
- ``DatasetWriter`` draws a tqdm progress bar per file; we log instead.

And one habit that costs every process seconds of start-up (the driver, each trial's worker;
benchmarks/input_pipeline.py times loader start-up):
``ffcv.fields.rgb_image`` fills a ``numba.typed.Dict`` (``IMAGE_MODES``, 'jpg' -> 0, 'raw' -> 1) at
import, and numba compiles that dict's methods, uncached, before the import returns. FFCV reads it
only from Python (the writer, and the decoders' ``generate_code`` before they compile), so a plain
dict does the same; we hand FFCV's import ``dict`` in place of ``numba.typed.Dict``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Iterator

_ffcv: types.ModuleType | None = None


@contextlib.contextmanager
def _plain_dict_as_numba_typed_dict() -> Iterator[None]:
    """``from numba.typed import Dict`` gives ``dict`` while FFCV imports (see above)."""
    import numba.typed

    typed_dict = numba.typed.Dict
    numba.typed.Dict = dict
    try:
        yield
    finally:
        numba.typed.Dict = typed_dict


def ffcv() -> types.ModuleType:
    """The ``ffcv`` package, imported and patched (idempotent)."""
    global _ffcv
    if _ffcv is not None:
        return _ffcv
    import torch

    threads = torch.get_num_threads()
    try:
        with _plain_dict_as_numba_typed_dict():
            import ffcv as module
            import ffcv.fields  # noqa: F401
            import ffcv.loader  # noqa: F401
            import ffcv.transforms  # noqa: F401
            import ffcv.writer
            from ffcv.pipeline.compiler import Compiler
    finally:
        torch.set_num_threads(threads)

    import numba
    from multiprocessing import cpu_count

    def set_num_threads(cls, n: int) -> None:  # FFCV's, minus torch.set_num_threads
        if n < 1:
            n = cpu_count()
        cls.num_threads = n
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))

    Compiler.set_num_threads = classmethod(set_num_threads)
    ffcv.writer.tqdm = functools.partial(ffcv.writer.tqdm, disable=True)
    _ffcv = module
    return module
