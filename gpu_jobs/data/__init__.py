"""Prompt data for the stages: built-in dataset generators, batch sampling, chat rendering, and
the data-quality gates on prompt datasets and rollout batches (`gpu_jobs.data.gates`).

Reading and writing verl-format Parquet is `storage.datasets`; this package is what needs a
seed or a tokenizer.
"""

from gpu_jobs.data.generators import (ARITH_SOURCE, GENERATORS, RG_SOURCE_PREFIX, TIMES_SOURCE, arith_pairs, arith_row,
                                      dataset_names, get_generator, make_dataset, register_generator)
from gpu_jobs.data.rendering import DatasetConfig, OverlongPromptError, render_many, render_prompt, render_prompts
from gpu_jobs.data.sampling import PromptSampler, epoch_and_step, epoch_permutation, sample_batch
# Registers the "arith_tools" generator and the "rlmill/arith_tools" scorer (multi-turn tools).
from gpu_jobs.data.tool_tasks import ARITH_TOOLS_SOURCE
# Registers the "calc3" generator and the "rlmill/calc3" scorer (the calculator environment's task).
from gpu_jobs.data.calc_tasks import CALC3_SOURCE

__all__ = ["ARITH_SOURCE", "ARITH_TOOLS_SOURCE", "CALC3_SOURCE", "GENERATORS", "RG_SOURCE_PREFIX", "TIMES_SOURCE", "arith_pairs", "arith_row",
           "dataset_names", "get_generator", "make_dataset", "register_generator", "DatasetConfig", "OverlongPromptError", "render_many",
           "render_prompt", "render_prompts", "PromptSampler", "epoch_and_step", "epoch_permutation", "sample_batch"]
