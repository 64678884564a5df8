"""Run under torchrun by test_pipeline.py: a pipeline-parallel update, HF checkpoint to OUT.

    torchrun --standalone --nproc_per_node 2 tests/train/pipeline_worker.py MODEL BATCH CONFIG_JSON OUT
"""

import json
import sys

import torch

torch.set_num_threads(1)

from gpu_jobs.train import TrainerConfig  # noqa: E402
from gpu_jobs.train.pipeline import PipelinePolicyTrainer  # noqa: E402
from storage import read_table  # noqa: E402

model, batch, config, out = sys.argv[1:5]
trainer = PipelinePolicyTrainer(model, TrainerConfig(**json.loads(config)))
metrics = trainer.update(read_table(batch))
trainer.save_hf(out)
if trainer.rank == 0:
    print(json.dumps(metrics), flush=True)
torch.distributed.destroy_process_group()
