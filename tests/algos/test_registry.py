import pytest

from gpu_jobs.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AdvantageEstimator,
    DuplicateNameError,
    Registry,
    UnknownNameError,
    agg_loss,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    kl_penalty,
)


def test_registry_register_get_and_duplicate():
    reg = Registry("toy")  # a fresh registry: tests never leave the global ones changed

    @reg.register("a")
    def a():
        return 1

    assert reg.get_fn("a") is a and "a" in reg and list(reg) == ["a"] and len(reg) == 1
    with pytest.raises(DuplicateNameError, match="already registered"):
        reg.register("a")(lambda: 2)
    assert reg["a"] is a  # the failed registration changed nothing


def test_global_registries_refuse_duplicates_without_changing():
    before = dict(ADVANTAGE_ESTIMATORS)
    with pytest.raises(DuplicateNameError):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda **k: None)
    assert dict(ADVANTAGE_ESTIMATORS) == before


def test_enum_members_are_keys():
    assert get_adv_estimator_fn(AdvantageEstimator.GRPO) is ADVANTAGE_ESTIMATORS["grpo"]
    assert AdvantageEstimator.RLOO in ADVANTAGE_ESTIMATORS


def test_all_families_listed():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(e.value for e in AdvantageEstimator)
    assert sorted(POLICY_LOSSES) == ["cispo", "clip_cov", "gpg", "gspo", "kl_cov", "vanilla"]
    assert sorted(LOSS_AGG_MODES) == [
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean",
    ]
    assert sorted(KL_ESTIMATORS) == ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]


@pytest.mark.parametrize(
    "call, listed",
    [
        (lambda: get_adv_estimator_fn("grpo2"), "grpo, grpo_passk"),
        (lambda: get_policy_loss_fn("ppo"), "cispo, clip_cov, gpg, gspo, kl_cov, vanilla"),
        (lambda: agg_loss(None, None, "mean"), "seq-mean-token-mean"),
        (lambda: kl_penalty(None, None, "k4"), "abs, k1, k2, k3, kl, low_var_kl, mse"),
    ],
)
def test_unknown_name_lists_valid(call, listed):
    with pytest.raises(UnknownNameError, match="valid names are") as info:
        call()
    assert listed in str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_docstring_examples_run():
    import doctest

    from gpu_jobs import registry
    from gpu_jobs.algos import advantages, config, kl

    for module in (registry, advantages, kl, config):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
