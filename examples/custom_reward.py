"""A reward function as verl's `custom_reward_function` calls it: 1 for the exact answer, else 0
(`partial`, a reward_kwargs entry, for a near miss: the right last digit).

    .venv/bin/rlmill train --config examples/grpo_arith.yaml reward.custom_reward_function.path=examples/custom_reward.py

It runs in the reward worker processes (`reward.num_workers`, `reward.timeout_s`); only this file
is loaded, never anything found on sys.path.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, partial=0.0):
    answer, truth = solution_str.strip(), str(ground_truth).strip()
    if answer == truth:
        return 1.0
    return float(partial) if answer[-1:] == truth[-1:] and answer else 0.0
