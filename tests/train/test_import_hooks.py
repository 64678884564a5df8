"""gpu_jobs/import_hooks.py: DeepSpeed imports without loading the MLflow client (2 s of CPU per
training process), and mlflow stays importable for the run's tracker."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mlflow")

PROBE = ("import sys, gpu_jobs, deepspeed; import deepspeed.autotuning.autotuner as a; "
         "print('loaded' if sys.modules.get('mlflow') else 'not-loaded', a.has_mlflow); "
         "import mlflow; print(callable(mlflow.start_run))")


def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports_after():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["not-loaded", "False", "True"], out.stderr[-2000:]
