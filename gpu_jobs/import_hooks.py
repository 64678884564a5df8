"""DeepSpeed without the MLflow client its autotuner loads at import time.

`deepspeed/autotuning/autotuner.py` runs `import mlflow` at module load (to log autotuning
experiments, which rlmill never runs), and `import deepspeed` always reaches it (through the
pipeline and config modules). Wherever mlflow is installed -- rlmill's own environment has it,
for `trainer.logger=[mlflow]` -- that is 2.0 of the 4.5 s of CPU an `import deepspeed` costs
here (`python -X importtime -c "import deepspeed"`), paid by every process that trains or saves
a model: each rank of a group, each flow run, each trainer subprocess. DeepSpeed is imported
from many places rlmill does not control (accelerate imports it inside `save_pretrained` to
unwrap engines), so the hook is on the import itself: while the `deepspeed` package's own code
runs, `import mlflow` raises ImportError, which the autotuner already reads as "no mlflow"; then
mlflow is importable again, and a run's tracker imports the real package as usual. When mlflow
is already imported, nothing is hidden.

Installed once per process by `gpu_jobs/__init__.py`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

__all__ = ["install_deepspeed_hook"]

_LOCK = threading.Lock()


class _HideMlflowWhileExecuting(importlib.abc.Loader):
    """Wraps the `deepspeed` package's loader: runs it with `mlflow` unimportable."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        with _LOCK:
            hide = "mlflow" not in sys.modules
            if hide:
                sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow -> ImportError
            try:
                self._inner.exec_module(module)
            finally:
                if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                    del sys.modules["mlflow"]

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._inner, name)


class _DeepSpeedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _HideMlflowWhileExecuting(spec.loader)
        return spec


def install_deepspeed_hook() -> None:
    """Put the finder first on sys.meta_path, once; nothing when deepspeed is already imported."""
    if "deepspeed" in sys.modules:
        return
    if not any(isinstance(f, _DeepSpeedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeepSpeedFinder())
