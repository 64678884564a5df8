"""The rank group: N DeepSpeed ranks under torchrun, kept warm for a run, and the proxy trainer
that speaks for them in the parent process. Process supervision only; one update's math lives
one level up (gpu_jobs.train.policy, .pipeline).

    group.py    RankGroup: start the ranks, send commands, watch them, tear them down
    failure.py  which rank failed first and how, as a RankGroupError
    processes.py  pidfd/flock/PR_SET_PDEATHSIG helpers and the group's local folder
    trainer.py  GroupTrainer: the policy trainer's surface, served by a RankGroup
    worker.py   one rank (``python -m gpu_jobs.train.ranks.worker``, started by torchrun)
    launch.py   torchrun command lines; ``python -m gpu_jobs.train.ranks.launch`` joins a node
    dist.py     the process group (gloo/nccl) every DeepSpeed engine runs in, one rank or many
    errors.py   RankGroupError, TrainerStateLostError

Nothing is imported here: ``import gpu_jobs.train.ranks.dist`` stays light.
"""
