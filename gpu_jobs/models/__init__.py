"""Models: the built-in tokenizer and tiny model, and loading HF causal LMs from anywhere.

Importing this package is light: torch/transformers load inside the functions that need them.
"""

from gpu_jobs.models.loading import (
    ensure_smollm2,
    load_model,
    load_tokenizer,
    read_state_dict,
    resolve_model_path,
)
from gpu_jobs.models.tiny import (
    WarmupRecipe,
    arith_problems,
    build_tiny_model,
    ensure_builtin_model,
    greedy_exact_match,
)
from gpu_jobs.models.tokenizer import build_tokenizer

__all__ = [
    "WarmupRecipe",
    "arith_problems",
    "build_tiny_model",
    "build_tokenizer",
    "ensure_builtin_model",
    "ensure_smollm2",
    "greedy_exact_match",
    "load_model",
    "load_tokenizer",
    "read_state_dict",
    "resolve_model_path",
]
