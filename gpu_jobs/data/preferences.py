"""Feedback rows -> DPO preference pairs and KTO examples. Pure: no storage, no tokenizer.

    rows = gpu_jobs.online.dataset.training_rows(root, "arith")
    pairs, counts = preference_pairs(rows)          # counts: why votes and pairs were dropped
    examples, counts = kto_examples(rows)            # labels from thumbs (majority)
    examples, counts = kto_examples(rows, label_from="reward", reward_threshold=0.5)

The rows are ``training_rows``' verl-format dicts (or the same read back from Parquet, whose
lists arrive as arrays): ``prompt`` (chat messages) and ``extra_info`` with ``answer_id``,
``index``, ``version``, ``response``, ``response_ids``, ``thumbs``, ``reward`` and
``preferred_over`` ("<answer id>#<choice>" of each answer this one won against, once per vote).
An answer is named by its ref, "<answer id>#<choice>".

Pairs: each vote "A over B" comes from A's ``preferred_over`` (B's ``rejected_for`` is its
mirror and is not counted again). Votes for the same two answers are merged: the direction with
more votes wins; a tie drops the pair. A pair is kept only if both answers are in the rows, were
given for the same prompt (a preference across prompts compares nothing the policy chose) and
differ (identical responses have a zero DPO gradient). Every drop is counted.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gpu_jobs.registry import Registry

__all__ = ["PreferencePair", "KTOExample", "KTO_LABELERS", "preference_pairs", "kto_examples", "answer_ref",
           "PREFERENCE_COLUMNS", "preference_file_rows", "arith_preference_rows", "check_preference_rows"]

_NEEDED = ("answer_id", "index", "version", "response", "response_ids", "thumbs", "reward", "preferred_over")

# The keys of the counts each builder returns, every one present (0 when nothing was dropped).
PAIR_COUNTS = ("votes", "pairs", "duplicate_votes", "outvoted_votes", "tied", "missing_answer",
               "different_prompt", "identical")
KTO_COUNTS = ("rows", "desirable", "undesirable", "tied", "unlabeled")


@dataclass(frozen=True)
class PreferencePair:
    """One DPO pair: the same ``prompt`` (chat messages) answered twice, ``chosen`` preferred.

    ``votes`` is how many times the preference was stated (net of votes the other way); the
    refs and versions say which served answers and model versions the pair came from."""

    prompt: list[dict[str, Any]]
    chosen: str
    chosen_ids: list[int]
    rejected: str
    rejected_ids: list[int]
    chosen_ref: str
    rejected_ref: str
    chosen_version: str
    rejected_version: str
    votes: int


@dataclass(frozen=True)
class KTOExample:
    """One KTO example: ``completion`` for ``prompt``, labelled ``desirable`` or not."""

    prompt: list[dict[str, Any]]
    completion: str
    completion_ids: list[int]
    desirable: bool
    ref: str
    version: str


def answer_ref(answer_id: str, index: int) -> str:
    """The name feedback uses for one choice of an answer: "<answer id>#<choice>"."""
    return f"{answer_id}#{int(index)}"


def _plain(x: Any) -> Any:
    """Lists, dicts and scalars all the way down (Parquet gives arrays for lists)."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _items(x: Any) -> list:
    """A list field that may be None (no signal of that kind) or an array."""
    return [] if x is None else list(_plain(x))


@dataclass(frozen=True)
class _Answer:
    ref: str
    prompt: list[dict[str, Any]]
    prompt_key: str
    response: str
    response_ids: list[int]
    version: str
    thumbs: list[str]
    reward: float | None
    preferred_over: list[str]


def _answers(rows: Sequence[dict[str, Any]]) -> dict[str, _Answer]:
    """ref -> answer, every row checked; a row without the needed fields raises, naming them."""
    out: dict[str, _Answer] = {}
    for i, row in enumerate(rows):
        answer = _answer(i, row)
        if answer.ref in out:
            raise ValueError(f"answer {answer.ref} appears in two feedback rows; pass each answer once "
                             "(training_rows gives one row per answer choice, with all of its feedback)")
        out[answer.ref] = answer
    return out


def _answer(i: int, row: Any) -> _Answer:
    row = row if isinstance(row, dict) else {}
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    missing = [k for k in ("prompt",) if k not in row] + [f"extra_info[{k!r}]" for k in _NEEDED if k not in extra]
    if missing:
        raise ValueError(f"feedback row {i} has no {', '.join(missing)}: pass the rows of "
                         "gpu_jobs.online.dataset.training_rows (extra_info carries the answer and its feedback)")
    prompt = _plain(row["prompt"])
    reward = extra["reward"]
    # A missing reward read back through pandas can arrive as NaN: it is "no reward", not a low one.
    reward = None if reward is None or math.isnan(float(reward)) else float(reward)
    return _Answer(ref=answer_ref(extra["answer_id"], extra["index"]), prompt=prompt,
                   prompt_key=json.dumps(prompt, sort_keys=True), response=str(extra["response"]),
                   response_ids=[int(t) for t in _items(extra["response_ids"])], version=str(extra["version"]),
                   thumbs=[str(t) for t in _items(extra["thumbs"])], reward=reward,
                   preferred_over=[str(r) for r in _items(extra["preferred_over"])])


def preference_pairs(rows: Sequence[dict[str, Any]]) -> tuple[list[PreferencePair], dict[str, int]]:
    """DPO pairs from feedback rows, in the order their first vote appears in ``rows``.

    Returns ``(pairs, counts)``; counts: ``votes`` (preferred_over entries read), ``pairs``
    (kept), ``duplicate_votes`` (further votes for a kept pair's direction), ``outvoted_votes``
    (votes against a kept pair's direction), and the distinct answer pairs dropped because
    the votes ``tied``, an answer was ``missing_answer``, the prompts differed
    (``different_prompt``) or the responses were ``identical`` (same text or same tokens).
    """
    answers = _answers(rows)
    votes: Counter[tuple[str, str]] = Counter()
    for a in answers.values():
        for loser in a.preferred_over:
            votes[(a.ref, loser)] += 1
    counts = dict.fromkeys(PAIR_COUNTS, 0)
    counts["votes"] = sum(votes.values())
    pairs, seen = [], set()
    for (winner, loser), n in votes.items():
        if frozenset((winner, loser)) in seen:
            continue
        seen.add(frozenset((winner, loser)))
        against = votes.get((loser, winner), 0) if loser != winner else 0
        if n == against:
            counts["tied"] += 1
            continue
        if against > n:
            winner, loser, n, against = loser, winner, against, n
        drop = _pair_problem(answers.get(winner), answers.get(loser))
        if drop:
            counts[drop] += 1
            continue
        counts["duplicate_votes"] += n - 1
        counts["outvoted_votes"] += against
        w, l = answers[winner], answers[loser]
        pairs.append(PreferencePair(prompt=w.prompt, chosen=w.response, chosen_ids=w.response_ids,
                                    rejected=l.response, rejected_ids=l.response_ids, chosen_ref=w.ref,
                                    rejected_ref=l.ref, chosen_version=w.version, rejected_version=l.version,
                                    votes=n - against))
    counts["pairs"] = len(pairs)
    return pairs, counts


def _pair_problem(winner: _Answer | None, loser: _Answer | None) -> str | None:
    """The count a pair is dropped under, or None to keep it."""
    if winner is None or loser is None:
        return "missing_answer"
    if winner.prompt_key != loser.prompt_key:
        return "different_prompt"
    if winner.response == loser.response or winner.response_ids == loser.response_ids:
        return "identical"
    return None


# ---------------------------------------------------------------------------------------------
# KTO labels: a labeler maps an answer to "desirable", "undesirable", "tied" or "unlabeled".

Label = Literal["desirable", "undesirable", "tied", "unlabeled"]


@dataclass(frozen=True)
class _Labeler:
    label: Callable[[_Answer, float | None], Label]
    uses_threshold: bool  # whether reward_threshold means anything to it


def _label_from_thumbs(answer: _Answer, reward_threshold: float | None) -> Label:
    # Majority of the answer's thumbs; as many up as down says nothing either way.
    up, down = answer.thumbs.count("up"), answer.thumbs.count("down")
    if up == down:
        return "unlabeled" if up == 0 else "tied"
    return "desirable" if up > down else "undesirable"


def _label_from_reward(answer: _Answer, reward_threshold: float | None) -> Label:
    # The row's reward against the threshold: the mean of its voters' ratings (gpu_jobs.online.signals.rating,
    # a row's score else its thumbs), the number the canary decides on.
    if answer.reward is None:
        return "unlabeled"
    if answer.reward == reward_threshold:
        return "tied"
    return "desirable" if answer.reward > reward_threshold else "undesirable"


KTO_LABELERS: Registry = Registry("KTO label source (label_from)")
KTO_LABELERS.register("thumbs")(_Labeler(_label_from_thumbs, uses_threshold=False))
KTO_LABELERS.register("reward")(_Labeler(_label_from_reward, uses_threshold=True))


def kto_examples(
    rows: Sequence[dict[str, Any]],
    *,
    label_from: str = "thumbs",
    reward_threshold: float | None = None,
) -> tuple[list[KTOExample], dict[str, int]]:
    """KTO examples from feedback rows, in row order.

    ``label_from="thumbs"``: desirable when an answer has more thumbs up than down, undesirable
    when fewer; equal numbers are ``tied`` and dropped; rows without thumbs are ``unlabeled``.
    ``label_from="reward"``: desirable when ``reward > reward_threshold``, undesirable when
    below, ``tied`` when equal; rows without a reward are ``unlabeled``. Returns
    ``(examples, counts)`` with counts ``rows``, ``desirable``, ``undesirable``, ``tied``, ``unlabeled``.
    """
    labeler: _Labeler = KTO_LABELERS[label_from]
    if labeler.uses_threshold and reward_threshold is None:
        raise ValueError(f"label_from={label_from!r} needs reward_threshold (rewards above it are desirable, "
                         "below it undesirable), e.g. reward_threshold=0.5")
    if not labeler.uses_threshold and reward_threshold is not None:
        raise ValueError(f"reward_threshold does nothing with label_from={label_from!r}; "
                         "drop it or set label_from='reward'")
    counts = dict.fromkeys(KTO_COUNTS, 0)
    examples = []
    for a in _answers(rows).values():
        counts["rows"] += 1
        label = labeler.label(a, reward_threshold)
        counts[label] += 1
        if label in ("desirable", "undesirable"):
            examples.append(KTOExample(prompt=a.prompt, completion=a.response, completion_ids=a.response_ids,
                                       desirable=label == "desirable", ref=a.ref, version=a.version))
    return examples, counts



# ---------------------------------------------------------------------------------------------
# Preference files: TRL's columns, what a preference run reads (gpu_jobs/stages/preference_data.py).

PREFERENCE_COLUMNS = {"dpo": ("prompt", "chosen", "rejected"), "kto": ("prompt", "completion", "label")}


def preference_file_rows(items: Sequence[PreferencePair | KTOExample]) -> list[dict[str, Any]]:
    """Pairs or KTO examples as rows of a preference file (TRL's columns, PREFERENCE_COLUMNS):
    what a retrain writes from ``preference_pairs`` / ``kto_examples`` and a preference run
    reads from ``preference.train_files``.

    >>> preference_file_rows([KTOExample([{"role": "user", "content": "1+1="}], "2", [50], True, "a#0", "v1")])
    [{'prompt': [{'role': 'user', 'content': '1+1='}], 'completion': '2', 'label': True}]
    """
    return [{"prompt": x.prompt, "chosen": x.chosen, "rejected": x.rejected} if isinstance(x, PreferencePair)
            else {"prompt": x.prompt, "completion": x.completion, "label": bool(x.desirable)} for x in items]


def arith_preference_rows(algorithm: str, problems: Sequence[tuple[int, int]], seed: int) -> list[dict[str, Any]]:
    """Preference rows for the built-in addition task "a+b=": DPO pairs with the correct sum
    chosen and a wrong one (off by 1..10, seeded) rejected; KTO rows alternating a correct
    (desirable) and a wrong (undesirable) answer, one per problem.

    >>> arith_preference_rows("dpo", [(12, 30)], seed=0)[0]["chosen"]
    '42'
    """
    import numpy as np

    if algorithm not in PREFERENCE_COLUMNS:
        raise ValueError(f"algorithm must be one of {sorted(PREFERENCE_COLUMNS)}, got {algorithm!r}")
    rng = np.random.default_rng(seed)
    rows = []
    for i, (a, b) in enumerate(problems):
        right = a + b
        off = int(rng.integers(1, 11)) * (1 if rng.random() < 0.5 else -1)
        prompt = [{"role": "user", "content": f"{a}+{b}="}]
        if algorithm == "dpo":
            rows.append({"prompt": prompt, "chosen": str(right), "rejected": str(right + off)})
        else:
            good = i % 2 == 0
            rows.append({"prompt": prompt, "completion": str(right if good else right + off), "label": good})
    return rows


def check_preference_rows(rows: Sequence[dict[str, Any]], algorithm: str, where: str) -> None:
    """Raise ValueError naming ``where`` (a file), the row and the fix when a preference row is
    unusable: a prompt that is not chat messages or text, an empty or non-text answer, a KTO
    label that is not a bool, a DPO pair whose two answers are the same (zero gradient)."""
    import numpy as np

    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                          for m in prompt)):
            raise ValueError(f"{where} row {i}: prompt must be chat messages [{{role, content}}] or a non-empty "
                             "string; fix the row or drop it")
        answers = ("chosen", "rejected") if algorithm == "dpo" else ("completion",)
        for col in answers:
            if not isinstance(row.get(col), str) or not row[col]:
                raise ValueError(f"{where} row {i}: {col} must be the assistant's answer as non-empty text, got "
                                 f"{row.get(col)!r}; fix the row or drop it")
        if algorithm == "dpo" and row["chosen"] == row["rejected"]:
            raise ValueError(f"{where} row {i}: chosen and rejected are the same text, which DPO learns nothing "
                             "from; drop the row")
        if algorithm == "kto" and not isinstance(row.get("label"), (bool, np.bool_)):
            raise ValueError(f"{where} row {i}: label must be true (desirable) or false (undesirable), got "
                             f"{row.get('label')!r}")

