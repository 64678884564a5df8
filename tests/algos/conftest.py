import random

import pytest
import torch

torch.set_num_threads(1)


def _batch(seed: int, bs: int = 7, T: int = 6, n_groups: int = 3, interior: bool = False):
    """Random rewards/values/logprobs with ragged right-padded masks and shuffled group ids.

    Some groups may have size 1; with ``interior`` some masks also have holes in the middle.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    if interior:
        holes = torch.rand(bs, T, generator=g) < 0.2
        holes[:, 0] = False
        mask = mask * (~holes).float()
    rng = random.Random(seed)
    index = [f"p{rng.randrange(n_groups)}" for _ in range(bs)]
    return {
        "token_level_rewards": torch.randn(bs, T, generator=g, dtype=torch.float64),
        "values": torch.randn(bs, T, generator=g, dtype=torch.float64),
        "response_mask": mask.double(),
        "index": index,
        "reward_baselines": torch.randn(bs, generator=g, dtype=torch.float64),
        "old_log_prob": -torch.rand(bs, T, generator=g, dtype=torch.float64) * 3,
        "log_prob": -torch.rand(bs, T, generator=g, dtype=torch.float64) * 3,
        "advantages": torch.randn(bs, T, generator=g, dtype=torch.float64),
    }


@pytest.fixture
def make_batch():
    return _batch
