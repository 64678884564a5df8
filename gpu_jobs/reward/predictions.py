"""The answer a response predicts, which validation's maj@n votes on.

    >>> extract_prediction("openai/gsm8k", "She pays 18 dollars.\\n#### 18")
    '18'
    >>> extract_prediction("rlmill/arith", " 82 ")
    '82'

Each built-in scorer's own extraction, routed by data_source like the scorers (exact names,
then prefixes); any other source votes on the stripped response text. A reward function that
returns a dict with "pred" (verl's reward_extra_info convention) decides for itself: the
validation stage uses that value instead.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_jobs.registry import Registry

from .rules import _ANSWER_TAG, gsm8k_extract, last_boxed_only_string, normalize_math_answer, remove_boxed

__all__ = ["PREDICTION_EXTRACTORS", "extract_prediction"]

Extractor = Callable[[str], str]
PREDICTION_EXTRACTORS: Registry = Registry("answer extractor for data_source")
_PREFIXES: Registry = Registry("answer extractor for data_source prefix")


def _strip(solution_str: str) -> str:
    return solution_str.strip()  # what arith_score compares


def _gsm8k(solution_str: str) -> str:
    return gsm8k_extract(solution_str, "strict") or ""  # "" = no answer: all such responses vote together


def _math(solution_str: str) -> str:
    boxed = last_boxed_only_string(solution_str)
    return normalize_math_answer(remove_boxed(boxed)) if boxed is not None else ""


def _tagged(solution_str: str) -> str:
    tagged = _ANSWER_TAG.findall(solution_str)
    return tagged[-1].strip() if tagged else solution_str.strip()


for _names, _fn in ((("rlmill/arith",), _strip), (("openai/gsm8k", "gsm8k"), _gsm8k),
                    (("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math",
                      "math_boxed"), _math)):
    for _name in _names:
        PREDICTION_EXTRACTORS.register(_name)(_fn)
_PREFIXES.register("reasoning_gym/")(_tagged)


def extract_prediction(data_source: str, solution_str: str) -> str:
    """The predicted answer of one response (module doc); never raises for an unknown source."""
    if data_source in PREDICTION_EXTRACTORS:
        return PREDICTION_EXTRACTORS[data_source](solution_str)
    for prefix, fn in _PREFIXES.items():
        if data_source.startswith(prefix):
            return fn(solution_str)
    return solution_str.strip()
