import pydantic
import pytest
import torch

from gpu_jobs.algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    AlgorithmConfig,
    FilterGroupsConfig,
    FixedKLController,
    KLConfig,
    KLControlConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    compute_advantage,
    get_policy_loss_fn,
)

ALL = [AlgorithmConfig, PolicyLossConfig, KLConfig, KLControlConfig, FilterGroupsConfig, OverlongBufferConfig]


def test_verl_defaults():
    a = AlgorithmConfig()
    assert (a.adv_estimator, a.gamma, a.lam, a.norm_adv_by_std_in_grpo, a.use_kl_in_reward, a.kl_penalty) == (
        "gae", 1.0, 1.0, True, False, "kl")
    assert (a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.horizon, a.kl_ctrl.target_kl) == ("fixed", 0.001, 10000, 0.1)
    p = PolicyLossConfig()
    assert (p.loss_mode, p.clip_ratio, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c, p.loss_agg_mode) == (
        "vanilla", 0.2, 0.2, 0.2, 3.0, "token-mean")
    assert (p.clip_cov_ratio, p.clip_cov_lb, p.clip_cov_ub, p.kl_cov_ratio, p.ppo_kl_coef) == (0.0002, 1.0, 5.0, 0.0002, 0.1)
    k = KLConfig()
    assert (k.use_kl_loss, k.kl_loss_coef, k.kl_loss_type) == (False, 0.001, "low_var_kl")
    assert a.needs_critic and not AlgorithmConfig(adv_estimator="grpo").needs_critic
    assert AlgorithmConfig(adv_estimator="remax").needs_reward_baselines


@pytest.mark.parametrize("cls", ALL)
def test_every_field_documented_and_extra_forbidden(cls):
    assert all(f.description for f in cls.model_fields.values())
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        cls(no_such_field=1)
    assert cls.model_validate(cls().model_dump()) == cls()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: PolicyLossConfig(clip_ratio_low=1.0), r"clip_ratio_low must be in \(0, 1\)"),
        (lambda: PolicyLossConfig(clip_ratio_high=0.0), "clip_ratio_high must be > 0"),
        (lambda: PolicyLossConfig(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
        (lambda: PolicyLossConfig(clip_cov_lb=5.0), "must be below clip_cov_ub"),
        (lambda: PolicyLossConfig(loss_mode="ppo"), "valid names are: cispo"),
        (lambda: PolicyLossConfig(loss_agg_mode="mean"), "valid names are"),
        (lambda: KLControlConfig(type="adaptive", target_kl=0.0), "needs target_kl > 0"),
        (lambda: KLControlConfig(type="adaptive", horizon=0), "needs horizon > 0"),
        (lambda: AlgorithmConfig(adv_estimator="ppo"), "valid names are: gae"),
        (lambda: AlgorithmConfig(kl_penalty="k9"), "is not a KL estimator"),
        (lambda: KLConfig(kl_loss_type="full"), "is not a KL estimator"),
        (lambda: FilterGroupsConfig(enable=True), "needs filter_groups.metric"),
        (lambda: OverlongBufferConfig(enable=True), "needs overlong_buffer.len > 0"),
        (lambda: FilterGroupsConfig(max_num_gen_batches=-1), "greater than or equal to 0"),
        (lambda: AlgorithmConfig(use_kl_in_reward=True, filter_groups={"enable": True, "metric": "seq_final_reward"}),
         "use filter_groups.metric='seq_reward'"),
        (lambda: AlgorithmConfig(gamma=1.5), "less than or equal to 1"),
    ],
)
def test_validation_says_how_to_fix(build, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        build()


def test_straight_through_names_accepted_and_controllers_built():
    assert KLConfig(kl_loss_type="k3+").kl_loss_type == "k3+"
    assert isinstance(KLControlConfig().build(), FixedKLController)
    ctrl = KLControlConfig(type="adaptive", kl_coef=0.2).build()
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.2


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_loss_kwargs_call_the_loss(mode):
    cfg = PolicyLossConfig(loss_mode=mode, clip_ratio_high=None, loss_agg_mode="seq-mean-token-mean")
    kw = cfg.loss_kwargs()
    assert kw["loss_agg_mode"] == "seq-mean-token-mean"
    if "clip_ratio_high" in kw:
        assert kw["clip_ratio_high"] == 0.2  # None resolves to clip_ratio
    x = -torch.rand(2, 3, dtype=torch.float64)
    loss, _ = get_policy_loss_fn(mode)(x, x + 0.1, torch.randn(2, 3, dtype=torch.float64), torch.ones(2, 3), **kw)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_advantage_kwargs_call_the_estimator(name):
    kw = AlgorithmConfig(adv_estimator=name, gamma=0.9, lam=0.9).advantage_kwargs()
    r, m = torch.rand(4, 3), torch.ones(4, 3)
    a, _ = compute_advantage(name, token_level_rewards=r, response_mask=m, index=[0, 0, 1, 1],
                             values=torch.rand(4, 3), reward_baselines=torch.rand(4), **kw)
    assert a.shape == (4, 3)


def test_dapo_fields_say_what_they_do():
    # Each of these keys is read: the help must name what reads it (no accepted-but-ignored keys).
    assert "overlong_reward" in OverlongBufferConfig.model_fields["log"].description
    assert "0 = no cap" in FilterGroupsConfig.model_fields["max_num_gen_batches"].description
    assert "'acc'" in FilterGroupsConfig.model_fields["metric"].description
    # seq_final_reward is fine without KL in the reward (it equals seq_reward then).
    AlgorithmConfig(filter_groups={"enable": True, "metric": "seq_final_reward"})
