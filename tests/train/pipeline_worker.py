"""Run under torchrun by test_pipeline.py: a pipeline-parallel update, HF checkpoint to OUT.

    torchrun --standalone --nproc_per_node 2 tests/train/pipeline_worker.py MODEL BATCH CONFIG_JSON OUT
"""

import json
import sys

import torch

torch.set_num_threads(1)

from gpu_jobs.train import ActorConfig  # noqa: E402
from gpu_jobs.train.pipeline import PipelinePolicyTrainer  # noqa: E402
from storage import read_table  # noqa: E402

model, batch, config, out = sys.argv[1:5]
config = ActorConfig(**json.loads(config))
table = read_table(batch)
trainer = PipelinePolicyTrainer(model, config)
metrics = trainer.update(table)
trainer.save_hf(out)
# exact resume: save, reload into a fresh trainer, and continue both on the same batch
trainer.save(out + "-state")
resumed = PipelinePolicyTrainer(model, config)
resumed.load(out + "-state")
straight_metrics, resumed_metrics = trainer.update(table), resumed.update(table)
a, b = trainer.gathered_state_dict(), resumed.gathered_state_dict()
metrics["resume_bitwise_equal"] = all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()
metrics["resume_same_pg_loss"] = straight_metrics["actor/pg_loss"] == resumed_metrics["actor/pg_loss"]
if trainer.rank == 0:
    print(json.dumps(metrics), flush=True)
torch.distributed.destroy_process_group()
