"""verl's command-line keys, translated to rlmill's: one table.

    rlmill train actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.rollout.n=5 \\
        data.train_files=$HOME/data/gsm8k/train.parquet trainer.total_training_steps=20
    rlmill config show actor_rollout_ref.rollout.name=vllm      # the translated config
    python -m flows.verl_keys                                   # the table: every verl key and its meaning

Every verl key a command line may hold is one of three things (``VERL_KEYS``):
- a rename: it sets rlmill keys, converting the value where the units or types differ
  (``actor_rollout_ref.actor.optim.lr`` -> ``actor.lr``; ``data.filter_overlong_prompts=True`` ->
  ``data.overlong_prompts=filter``);
- accepted: it names something rlmill already does, so it changes nothing (the table says what;
  e.g. ``data.return_raw_chat``: rlmill always renders prompts from the chat messages), or it only
  moves memory around in verl's FSDP workers (``fsdp_config.param_offload``); values that would
  mean something rlmill does not do are rejected;
- rejected, with the reason.
A key under a verl-only section (``actor_rollout_ref``, ``custom_reward_function``, ``reward_model``,
...) that the table does not know is rejected too. Keys that are already rlmill's (``data.*``,
``algorithm.*``, ``trainer.n_gpus_per_node``, ...) pass through unchanged. All rejected keys of one
command line are reported in ONE error, before any work.

As in verl (hydra), a key given twice takes its last value. A verl key and the rlmill key it sets
(or two verl keys setting one rlmill key) given with different values is an error. hydra's forms
work on either kind of key (flows/overrides.py): `+key=v` and `++key=v` set it, `~key` resets what
it sets to rlmill's defaults (`~key=v` only when the value is v). A YAML config file may use verl's
section names: its keys are translated the same way (``translate_tree``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flows.overrides import Delete, Override, OverrideError, item_of, parse_override
from gpu_jobs.stages.config import ConfigError

__all__ = ["VERL_KEYS", "VERL_SECTIONS", "Rule", "TotalEpochs", "translate", "translate_tree", "resolve_total_epochs"]

# Top-level sections that exist only in verl: any key below them must be in the table.
VERL_SECTIONS = ("actor_rollout_ref", "custom_reward_function", "reward_model", "reward_manager",
                 "global_profiler", "ray_kwargs", "ray_init", "transfer_queue")


class Unsupported(ValueError):
    """A verl key, or a value of it, that rlmill does not support; the message says why."""


@dataclasses.dataclass(frozen=True)
class TotalEpochs:
    """`trainer.total_epochs=n`: resolved to n passes over the train rows once the data is known
    (``resolve_total_epochs``); any explicit total_training_steps / total_iterations wins, as in verl."""

    epochs: int


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one verl key reaches rlmill: ``to(value) -> {rlmill key: value}`` ({} = accepted, changes
    nothing); raises Unsupported for values rlmill cannot honour. ``doc`` says what it means here."""

    doc: str
    to: Callable[[Any], dict[str, Any]]
    targets: tuple[str, ...] = ()  # the rlmill keys `to` may set
    refused: str = ""  # why rlmill refuses the key whatever its value (`reject`): `~key` is refused too


def rename(target: str, convert: Callable[[Any], Any] = lambda v: v, doc: str = "") -> Rule:
    return Rule(doc or f"-> {target}", lambda v: {target: convert(v)}, (target,))


def accept(doc: str, allowed: Callable[[Any], bool] = lambda v: True, otherwise: str = "") -> Rule:
    def to(v: Any) -> dict[str, Any]:
        if not allowed(v):
            raise Unsupported(otherwise)
        return {}
    return Rule(f"accepted: {doc}", to)


def reject(reason: str) -> Rule:
    def to(v: Any) -> dict[str, Any]:
        raise Unsupported(reason)
    return Rule(f"rejected: {reason}", to, refused=reason)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unset_below(limit: float, target: str) -> Callable[[Any], dict[str, Any]]:
    """verl's 'not set' sentinels (-1, null): leave rlmill's default; else set `target` (a value
    that is not a number goes on for the config's own check to name)."""
    return lambda v: {} if v is None or (_number(v) and v < limit) else {target: v}


def _as_list(v: Any) -> list[str]:
    # verl takes one file or a list of files; rlmill always a list.
    return [v] if isinstance(v, str) else list(v)


def _logger(v: Any) -> dict[str, Any]:
    names = [v] if isinstance(v, str) else list(v)
    unknown = [n for n in names if n not in ("console", "tensorboard", "wandb", "mlflow")]
    if unknown:
        raise Unsupported(f"logger(s) {unknown} are not available: rlmill logs to the console always, and to "
                          "'tensorboard', 'wandb', 'mlflow'")
    return {"trainer.tensorboard": "tensorboard" in names,
            "trainer.loggers": [n for n in names if n in ("wandb", "mlflow")]}


def _total_epochs(v: Any) -> dict[str, Any]:
    if not _number(v) or v < 1 or v != int(v):
        raise Unsupported("trainer.total_epochs must be a whole number >= 1")
    return {"trainer.total_iterations": TotalEpochs(int(v))}


def _rollout_name(v: Any) -> dict[str, Any]:
    from gpu_jobs.rollout import ROLLOUT_ENGINES  # the package registers the built-in engines

    if not isinstance(v, str) or v not in ROLLOUT_ENGINES:
        raise Unsupported(f"rlmill's rollout engines are {', '.join(map(repr, sorted(ROLLOUT_ENGINES)))} "
                          "(gpu_jobs.rollout.ROLLOUT_ENGINES; 'hf' is transformers)")
    return {"rollout.engine": v}


def _one(what: str, fix: str) -> Rule:
    """A parallelism degree rlmill does not split over: 1 (or verl's -1 'auto') is accepted."""
    return accept(f"{what}; rlmill runs it whole", lambda v: v in (1, -1), f"{what} > 1 is not supported: {fix}")


_MEMORY = ("FSDP memory placement in verl's workers (it changes memory use, not results); rlmill shards "
           "with DeepSpeed ZeRO (actor.zero_stage) and keeps parameters and optimizer state on the trainer's device")
_FSDP_MEMORY_KEYS = ("param_offload", "optimizer_offload", "offload_policy", "reshard_after_forward",
                     "forward_prefetch", "fsdp_size", "wrap_policy.min_num_params")
_STRATEGY = accept("rlmill's trainer is DeepSpeed data parallel (ZeRO), the same math as FSDP",
                   lambda v: v in ("fsdp", "fsdp2"), "megatron is not supported: rlmill trains with DeepSpeed ZeRO")


def _actor_rules() -> dict[str, Rule]:
    a = "actor_rollout_ref.actor."
    same = ["ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
            "ppo_epochs", "shuffle", "entropy_coeff", "entropy_from_logits_with_chunking", "use_remove_padding",
            "grad_clip"]
    rules = {a + k: rename(f"actor.{k}") for k in same}
    for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode"):
        rules[a + k] = rename(f"actor.policy_loss.{k}")
    for k in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef"):
        rules[a + "policy_loss." + k] = rename(f"actor.policy_loss.{k}")
    for k in ("use_kl_loss", "kl_loss_coef", "kl_loss_type"):
        rules[a + k] = rename(f"actor.kl_loss.{k}")
    for k, target in (("lr", "lr"), ("weight_decay", "weight_decay"), ("betas", "betas"),
                      ("min_lr_ratio", "min_lr_ratio"), ("clip_grad", "grad_clip"),
                      ("lr_scheduler_type", "lr_scheduler"), ("warmup_style", "lr_scheduler")):
        rules[a + "optim." + k] = rename(f"actor.{target}")
    rules[a + "optim.lr_warmup_steps"] = Rule("-> actor.lr_warmup_steps (-1: not set)",
                                              _unset_below(0, "actor.lr_warmup_steps"), ("actor.lr_warmup_steps",))
    rules[a + "optim.total_training_steps"] = Rule("-> actor.total_training_steps (-1: not set)",
                                                   _unset_below(1, "actor.total_training_steps"),
                                                   ("actor.total_training_steps",))
    rules[a + "optim.lr_warmup_steps_ratio"] = accept(
        "0 = no warm-up (rlmill's default)", lambda v: v == 0,
        "a warm-up ratio is not supported: give actor_rollout_ref.actor.optim.lr_warmup_steps (update calls)")
    rules[a + "ppo_micro_batch_size"] = reject(
        "deprecated in verl (a global count): give actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    rules[a + "ulysses_sequence_parallel_size"] = _one("sequence parallelism", "set it to 1")
    rules[a + "strategy"] = _STRATEGY
    rules[a + "loss_scale_factor"] = accept(
        "null = normalise by the batch (rlmill's loss_agg_mode does)", lambda v: v is None,
        "a constant loss scale is not supported: leave it null")
    rules[a + "use_torch_compile"] = accept("compiles verl's entropy kernel: speed only")
    return rules


def _model_rollout_ref_rules() -> dict[str, Rule]:
    m, r, ref = "actor_rollout_ref.model.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
    rules = {
        m + "path": rename("model.path"),
        m + "use_remove_padding": rename("actor.use_remove_padding"),
        m + "enable_gradient_checkpointing": rename("actor.gradient_checkpointing"),
        m + "lora_rank": rename("model.lora_rank"),
        m + "lora_alpha": rename("model.lora_alpha"),
        m + "target_modules": rename("model.target_modules"),
        m + "trust_remote_code": accept("rlmill loads no remote code", lambda v: v is False,
                                        "rlmill does not run a model repository's own code: use a model "
                                        "transformers supports"),
        m + "enable_activation_offload": accept("off, as in rlmill", lambda v: v is False,
                                                "activation offload is not supported: use "
                                                "actor_rollout_ref.model.enable_gradient_checkpointing=True"),
        m + "use_shm": accept("loads the model through /dev/shm in verl: loading speed only"),
        "actor_rollout_ref.hybrid_engine": accept("rollout and trainer share the process (trainer.placement="
                                                  "colocated)", lambda v: v is True,
                                                  "use trainer.placement=remote for separate stage workers"),
        r + "name": Rule("a registered rollout engine (vllm, hf) -> rollout.engine", _rollout_name,
                         ("rollout.engine",)),
        r + "response_length": rename("rollout.max_response_length"),
        r + "prompt_length": rename("data.max_prompt_length"),
        r + "dtype": rename("rollout.engine_options.dtype"),
        r + "gpu_memory_utilization": rename("rollout.engine_options.gpu_memory_utilization"),
        r + "enforce_eager": rename("rollout.engine_options.enforce_eager"),
        r + "max_model_len": rename("rollout.engine_options.max_model_len"),
        r + "max_num_seqs": rename("rollout.engine_options.max_batch_size"),
        r + "log_prob_micro_batch_size_per_gpu": rename("actor.log_prob_micro_batch_size_per_gpu"),
        r + "tensor_model_parallel_size": rename("rollout.engine_options.tensor_parallel_size"),
        r + "data_parallel_size": rename("rollout.engine_options.data_parallel_size"),
        r + "do_sample": Rule("False -> rollout.temperature=0 (greedy)",
                              lambda v: {} if v else {"rollout.temperature": 0.0}, ("rollout.temperature",)),
        r + "mode": accept("sync or async serving inside verl's rollout workers: the same samples; rlmill runs "
                           "rollout as a stage (async_training.staleness_threshold is its off-policy mode)"),
        r + "free_cache_engine": accept("frees vLLM's KV cache between rollouts in verl: memory only"),
        r + "load_format": accept("how verl's vLLM first loads weights; rlmill loads the model, then syncs the "
                                  "trainer's weights in memory"),
        r + "enable_chunked_prefill": accept("vLLM scheduling: speed only"),
        r + "enable_prefix_caching": accept("vLLM scheduling: speed only"),
        r + "max_num_batched_tokens": accept("vLLM scheduling: speed only"),
        r + "calculate_log_probs": accept("rlmill always records the rollout's log-probs"),
        **{r + f"val_kwargs.{k}": rename(f"rollout.val_kwargs.{k}")
           for k in ("n", "do_sample", "temperature", "top_p", "top_k")},
        ref + "log_prob_micro_batch_size_per_gpu": rename("actor.log_prob_micro_batch_size_per_gpu",
                                                          doc="-> actor.log_prob_micro_batch_size_per_gpu "
                                                          "(the reference model scores in the same micro-batches)"),
        ref + "strategy": _STRATEGY,
    }
    rules.update({r + k: rename(f"rollout.{k}") for k in ("n", "temperature", "top_p", "top_k", "ignore_eos")})
    rules.update(_multi_turn_rules(r))
    for role in ("actor", "ref"):
        for k in _FSDP_MEMORY_KEYS:
            rules[f"actor_rollout_ref.{role}.fsdp_config.{k}"] = accept(_MEMORY)
    return rules


def _multi_turn_rules(r: str) -> dict[str, Rule]:
    """verl's rollout.multi_turn keys: the same names in rlmill's section; tool_config_path's YAML
    is read as verl writes it, with a Python path (or a built-in tool) as class_name, and
    interaction_config_path's with one interaction (a verl class by module path, or a built-in)."""
    return {r + f"multi_turn.{k}": rename(f"rollout.multi_turn.{k}")
            for k in ("enable", "max_assistant_turns", "max_tool_response_length", "tool_response_truncate_side",
                      "format", "max_parallel_calls", "tool_config_path", "interaction_config_path")}


def _data_rules() -> dict[str, Rule]:
    d = "data."
    return {
        d + "train_files": rename("data.train_files", _as_list, "one file or a list -> data.train_files (a list)"),
        d + "val_files": rename("data.val_files", _as_list, "one file or a list -> data.val_files (a list)"),
        d + "max_response_length": rename("rollout.max_response_length"),
        d + "filter_overlong_prompts": rename("data.overlong_prompts", lambda v: "filter" if v else "error",
                                              "True/False -> data.overlong_prompts=filter/error"),
        d + "truncation": accept("a prompt longer than max_prompt_length is an error unless filtered "
                                 "(rlmill never truncates)", lambda v: v == "error",
                                 "rlmill never truncates prompts: use data.truncation=error, with "
                                 "data.filter_overlong_prompts=True to drop long prompts"),
        d + "return_raw_chat": accept("rlmill always renders prompts from the chat messages"),
        d + "shuffle": accept("each epoch is a seeded permutation of the rows (data.seed)", lambda v: v is True,
                              "rlmill always shuffles (a pure function of data.seed and the epoch)"),
        d + "seed": Rule("-> data.seed (null: not set)", lambda v: {} if v is None else {"data.seed": v}, ("data.seed",)),
        d + "val_max_samples": Rule("-> data.val_size (-1: not set)", _unset_below(1, "data.val_size"), ("data.val_size",)),
        d + "train_max_samples": accept("-1: every row", lambda v: v in (-1, None),
                                        "not supported: write a smaller train file (rlmill data make --train-size)"),
        d + "val_batch_size": accept("validation runs in one pass", lambda v: v is None),
        d + "reward_fn_key": accept("scorers are routed by data_source", lambda v: v == "data_source",
                                    "rlmill routes scorers by data_source: leave it data_source or use "
                                    "custom_reward_function.path"),
        d + "dataloader_num_workers": accept("reader processes in verl: speed only"),
        d + "filter_overlong_prompts_workers": accept("filter processes in verl: speed only"),
        d + "tokenizer": accept("the model's own tokenizer", lambda v: v is None,
                                "rlmill uses the model folder's tokenizer: leave data.tokenizer null"),
    }


def _trainer_reward_rules() -> dict[str, Rule]:
    t = "trainer."
    return {
        t + "total_epochs": Rule("-> trainer.total_iterations = total_epochs x (train rows // "
                                 "data.train_batch_size), unless total_training_steps is given (as in verl)",
                                 _total_epochs, ("trainer.total_iterations",)),
        t + "total_training_steps": Rule("-> trainer.total_iterations (null: from total_epochs)",
                                         _unset_below(1, "trainer.total_iterations"), ("trainer.total_iterations",)),
        t + "save_freq": Rule("-> trainer.checkpoint_every (-1: only the final checkpoint)",
                              lambda v: {"trainer.checkpoint_every": v if not _number(v) or v > 0 else 10**9},
                              ("trainer.checkpoint_every",)),
        t + "test_freq": Rule("-> trainer.val_every (-1: validate only before and after)",
                              lambda v: {"trainer.val_every": max(v, 0) if _number(v) else v}, ("trainer.val_every",)),
        t + "logger": Rule("console always; tensorboard -> trainer.tensorboard; wandb/mlflow -> trainer.loggers",
                           _logger, ("trainer.tensorboard", "trainer.loggers")),
        t + "experiment_name": rename("run_id", doc="-> run_id: the same name resumes the run (verl's "
                                      "resume_mode=auto)"),
        t + "project_name": accept("groups experiments in verl's checkpoint folder; rlmill's runs live under "
                                   "<root>/runs/<run_id> (trainer.experiment_name)"),
        t + "critic_warmup": Rule("-> critic.critic_warmup (0: the actor trains from iteration 1, rlmill's "
                                  "default)", lambda v: {} if v == 0 else {"critic.critic_warmup": v}, ("critic.critic_warmup",)),
        t + "val_before_train": rename("trainer.val_before_train"),
        t + "resume_mode": accept("a named run resumes where it stopped", lambda v: v == "auto",
                                  "only 'auto' is supported: a new trainer.experiment_name starts a new run"),
        t + "balance_batch": accept("balances tokens across data-parallel ranks in verl: speed only "
                                    "(actor.use_dynamic_bsz packs micro-batches by tokens)"),
        "custom_reward_function.path": rename("reward.custom_reward_function.path"),
        "custom_reward_function.name": rename("reward.custom_reward_function.name"),
        "custom_reward_function.reward_kwargs": rename("reward.custom_reward_function.reward_kwargs"),
        # rlmill's reward_model section uses verl's names (its own `combine` and `coef` set how the
        # model's score meets the rule's): they pass through unchanged.
        **{f"reward_model.{k}": rename(f"reward_model.{k}")
           for k in ("enable", "model.path", "micro_batch_size_per_gpu", "max_length", "combine", "coef")},
        "reward_model.reward_manager": accept(
            "naive: one scorer call per response; dapo: the same, with reward_model.overlong_buffer",
            lambda v: v in ("naive", "dapo"), "only the naive and dapo reward managers are supported"),
        "reward_model.launch_reward_fn_async": accept("rlmill scores in worker processes (reward.num_workers)"),
        **{f"reward_model.overlong_buffer.{k}": rename(f"overlong_buffer.{k}")
           for k in ("enable", "len", "penalty_factor", "log")},
        "algorithm.use_pf_ppo": accept("off", lambda v: v is False, "PF-PPO reweighting is not supported"),
    }


# verl keys in the sections rlmill shares with verl (data, trainer, algorithm) that have no
# equivalent here: named as verl keys in the one error, not as typos of rlmill keys.
_NO_EQUIVALENT = (
    "trainer.default_local_dir trainer.default_hdfs_dir trainer.del_local_ckpt_after_load "
    "trainer.max_actor_ckpt_to_keep trainer.max_critic_ckpt_to_keep trainer.resume_from_path trainer.val_only "
    "trainer.log_val_generations trainer.rollout_data_dir trainer.validation_data_dir trainer.esi_redundant_time "
    "trainer.ray_wait_register_center_timeout trainer.device trainer.use_legacy_worker_impl "
    "data.use_shm data.return_raw_input_ids data.return_full_prompt data.validation_shuffle data.image_key "
    "data.video_key data.image_patch_size data.trust_remote_code data.custom_cls.path data.custom_cls.name "
    "data.return_multi_modal_inputs data.sampler.class_path data.sampler.class_name data.datagen.path "
    "data.datagen.name data.apply_chat_template_kwargs data.tool_config_path algorithm.pf_ppo.reweight_method "
    "algorithm.pf_ppo.weight_pow algorithm.rollout_correction.bypass_mode algorithm.rollout_correction.loss_type "
    "algorithm.rollout_correction.rollout_is_batch_normalize"
).split()

VERL_KEYS: dict[str, Rule] = {**_actor_rules(), **_model_rollout_ref_rules(), **_data_rules(),
                              **_trainer_reward_rules(),
                              **{k: reject("verl key rlmill does not support (no equivalent here)")
                                 for k in _NO_EQUIVALENT}}


def _section_of(key: str) -> str | None:
    head = key.split(".", 1)[0]
    return head if head in VERL_SECTIONS else None


def translate(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """Parsed overrides (hydra's forms: `key=v`, `+key=v`, `++key=v`, `~key[=v]`) with verl's keys
    translated: [(rlmill key path, value or overrides.Delete), ...] in the order given. Raises
    ConfigError listing every rejected verl key, or every key given two values."""
    parsed = []
    for text in overrides:
        try:
            parsed.append(parse_override(text))
        except OverrideError as exc:
            raise ConfigError(str(exc)) from None
    return translate_parsed(parsed)


def translate_tree(data: dict[str, Any]) -> list[tuple[list[str], Any]]:
    """A YAML config's mapping as translated items: verl's section names (``actor_rollout_ref:``,
    ``data:``, ``trainer:``, ...) mean what the same dotted keys mean on a command line; rlmill's
    own keys pass through unchanged. Raises ConfigError as ``translate`` does."""
    return translate_parsed([Override("set", tuple(path), value) for path, value in _leaves(data)])


def _leaves(node: dict[str, Any], prefix: tuple[str, ...] = ()):
    """(key path, value) of a nested mapping, stopping at a verl key (its value may be a mapping,
    e.g. custom_reward_function.reward_kwargs) and at an empty mapping (``critic: {}`` turns the
    critic on)."""
    for key, value in node.items():
        path = (*prefix, str(key))
        if isinstance(value, dict) and value and ".".join(path) not in VERL_KEYS:
            yield from _leaves(value, path)
        else:
            yield path, value


def translate_parsed(parsed: list[Override]) -> list[tuple[list[str], Any]]:
    """``translate`` on parsed overrides."""
    last = {o.key: i for i, o in enumerate(parsed) if not o.deletes}
    items: list[tuple[list[str], Any]] = []
    setters: dict[str, dict[str, Any]] = {}  # rlmill key -> {source key: final value}
    rejected: list[str] = []
    for i, o in enumerate(parsed):
        key, rule = o.key, VERL_KEYS.get(o.key)
        verl = rule is not None or _section_of(key) is not None
        try:
            if verl and o.has_value:
                _no_interpolation(o.value)
            if o.deletes:
                for path, value in _deletions(o, rule, verl):
                    items.append((path, value))
                    setters.pop(".".join(path), None)  # what was set before is gone: no conflict with it
                continue
            if not verl:
                items.append((list(o.path), o.value))  # rlmill's own key (pydantic checks it)
                if last[key] == i:
                    setters.setdefault(key, {})[key] = o.value
                continue
            if last[key] != i:
                continue  # a verl key given again later: the last value wins, as in hydra
            if rule is None:
                raise Unsupported("verl key rlmill does not support (no equivalent here)")
            for target, v in rule.to(o.value).items():
                items.append((target.split("."), v))
                setters.setdefault(target, {})[key] = v
        except Unsupported as exc:
            shown = f"{'~' if o.deletes else ''}{key}" + (f"={o.value!r}" if o.has_value and rule else "")
            rejected.append(f"  {shown}: {exc}")
    if rejected:
        raise ConfigError("verl keys rlmill does not support (fix or drop each; `python -m flows.verl_keys` "
                          "lists the verl keys rlmill translates):\n" + "\n".join(rejected))
    return _without_conflicts(items, setters)


def _no_interpolation(value: Any) -> None:
    if isinstance(value, str) and "${" in value:
        raise Unsupported("hydra interpolation (${...}) is not supported: write the value itself")


def _deletions(o: Override, rule: Rule | None, verl: bool) -> list[tuple[list[str], Any]]:
    """`~key[=value]` as Delete items on rlmill keys: the key itself, or what a verl key sets.
    With a value, a verl key's value is translated first and the rlmill keys must hold that."""
    if not verl:
        return [item_of(o)]
    if rule is None:
        raise Unsupported("verl key rlmill does not support (no equivalent here)")
    if rule.refused:
        raise Unsupported(rule.refused)
    if not o.has_value:
        return [(target.split("."), Delete()) for target in rule.targets]  # accepted keys set nothing
    expected = rule.to(o.value)  # {}: a value rlmill already follows; an unsupported one raises
    return [(target.split("."), Delete(expected[target]) if target in expected else Delete())
            for target in rule.targets]


def _without_conflicts(items: list[tuple[list[str], Any]], setters: dict[str, dict[str, Any]]):
    """Raise on an rlmill key set to different values by different keys; drop total_epochs when an
    explicit step count is given (verl: total_training_steps wins over total_epochs)."""
    clashes = []
    for target, sources in setters.items():
        explicit = {src: v for src, v in sources.items() if not isinstance(v, TotalEpochs)}
        if explicit and len(explicit) < len(sources):
            items = [(p, v) for p, v in items if not (".".join(p) == target and isinstance(v, TotalEpochs))]
        values = list(explicit.values())
        if any(v != values[0] for v in values[1:]):
            shown = ", ".join(f"{src}={v!r}" for src, v in explicit.items())
            clashes.append(f"  {target} is given different values: {shown}")
    if clashes:
        raise ConfigError("conflicting overrides (a verl key and the rlmill key it sets must agree; give one):\n"
                          + "\n".join(clashes))
    return items


def has_total_epochs(data: dict[str, Any]) -> bool:
    return isinstance((data.get("trainer") or {}).get("total_iterations"), TotalEpochs)


def resolve_total_epochs(data: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """`data` with trainer.total_iterations = total_epochs x (train rows // data.train_batch_size),
    verl's count of steps (its dataloader drops the last partial batch, as rlmill's sampler does).
    `cfg` is the run config validated with a placeholder count: it names the files and the batch.
    Rows are counted in the train files (before data.filter_overlong_prompts drops any), or
    data.train_size for a generated dataset."""
    epochs = data["trainer"]["total_iterations"].epochs
    rows = _train_rows(cfg)
    steps = rows // cfg.data.train_batch_size
    if steps == 0 or epochs < 1:
        raise ConfigError(f"trainer.total_epochs={epochs} with {rows} train rows and data.train_batch_size="
                          f"{cfg.data.train_batch_size} gives no iterations: lower the batch or give "
                          "trainer.total_training_steps")
    return {**data, "trainer": {**data["trainer"], "total_iterations": epochs * steps}}


def _train_rows(cfg: Any) -> int:
    if not cfg.data.train_files:
        return cfg.data.train_size
    import pyarrow.parquet as pq

    from storage.fs import url_to_fs

    rows = 0
    for url in cfg.data.train_files:
        try:
            fs, path = url_to_fs(url, cfg.storage)
            with fs.open(path, "rb") as f:
                rows += pq.ParquetFile(f).metadata.num_rows
        except (OSError, ValueError) as exc:
            raise ConfigError(f"trainer.total_epochs counts the rows of data.train_files, but {url} cannot be "
                              f"read ({type(exc).__name__}: {exc}): fix the path, or give "
                              "trainer.total_training_steps") from None
    return rows


def main() -> None:
    """`python -m flows.verl_keys`: every verl key rlmill knows, and what it does here."""
    width = max(map(len, VERL_KEYS))
    for key in sorted(VERL_KEYS):
        print(f"{key:<{width}}  {VERL_KEYS[key].doc}")
    print(f"{'(any other key under ' + ', '.join(VERL_SECTIONS) + ')'}  rejected: no equivalent in rlmill")


if __name__ == "__main__":
    main()
