"""Built-in rule scorers: GSM8K, 2-digit arithmetic, boxed math answers, reasoning-gym tasks.

Each has verl's scorer shape `score(solution_str, ground_truth, ...) -> float`; the registry
(`gpu_jobs.reward.registry`) routes a `data_source` to one of them.

    >>> gsm8k_score("... so she has 18 eggs.\\n#### 18", "18")
    1.0
    >>> math_score("The answer is $\\\\boxed{\\\\frac{1}{2}}$.", "1/2")
    1.0
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

__all__ = [
    "gsm8k_extract",
    "gsm8k_score",
    "arith_score",
    "last_boxed_only_string",
    "remove_boxed",
    "normalize_math_answer",
    "math_score",
    "reasoning_gym_score",
    "decode_rg_entry",
]

# --------------------------------------------------------------------------------------------
# GSM8K (verl utils/reward_score/gsm8k.py; Trung et al. 2024, "ReFT")
# --------------------------------------------------------------------------------------------
_GSM8K_CLIP_CHARS = 300  # verl looks only at the tail: long answers cost regex time, not accuracy
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """The final answer in a GSM8K-style solution, or None.

    strict: the number after "#### " (the format the dataset teaches); commas and "$" removed.
    flexible: the last number anywhere in the text (not "" or ".").
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(text)
        if not found:
            return None
        return found[-1].replace(",", "").replace("$", "")
    for candidate in reversed(_GSM8K_NUMBER.findall(text)):
        if candidate not in ("", "."):
            return candidate.replace(",", "")
    return None


def gsm8k_score(
    solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if an answer was
    found but is wrong, 0.0 if none was found (verl's gsm8k.compute_score)."""
    answer = gsm8k_extract(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).replace(",", "").strip() else float(format_score)


# --------------------------------------------------------------------------------------------
# Built-in arithmetic task (rlmill/arith)
# --------------------------------------------------------------------------------------------
def arith_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the decoded response, stripped, is exactly the ground truth ("82"), else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last number in the response (commas dropped) is the ground truth, else 0.0:
    "7 x 8 = 56", "56" and "It is 56." score; "8 x 7 = 54" does not (the times-table task).
    Unlike GSM8K's flexible extraction, a sentence's full stop is not part of the number."""
    found = _LAST_NUMBER.findall(solution_str[-_GSM8K_CLIP_CHARS:])
    return 1.0 if found and found[-1].replace(",", "") == str(ground_truth).strip() else 0.0


# --------------------------------------------------------------------------------------------
# Math with \boxed{} answers (verl utils/reward_score/math.py; Hendrycks et al. 2021, "MATH")
# --------------------------------------------------------------------------------------------
def last_boxed_only_string(text: str) -> str | None:
    r"""The last `\boxed{...}` (or `\fbox{...}`, or `\boxed x`) in `text`, braces balanced; None if absent."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):
        rest = text[idx + len("\\boxed ") :]
        return "\\boxed " + rest.split("$")[0].strip()
    depth = 0
    for j in range(idx, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : j + 1]
    return None


def remove_boxed(boxed: str) -> str:
    r"""`\boxed{x}` -> `x`, `\fbox{x}` -> `x`, `\boxed x` -> `x`."""
    for left in ("\\boxed ", "\\boxed{", "\\fbox{"):
        if boxed.startswith(left):
            inner = boxed[len(left) :]
            return inner if left.endswith(" ") else inner[:-1]
    return boxed


_UNIT_TEXT = re.compile(r"\\text\{\s*[^{}]*\}\s*$")


def _fix_fracs(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{72} -> \frac{1}{72}
    parts = s.split("\\frac")
    out = parts[0]
    for sub in parts[1:]:
        out += "\\frac"
        if sub.startswith("{") or len(sub) < 2:
            out += sub
            continue
        a, b, tail = sub[0], sub[1], sub[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _fix_a_slash_b(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def normalize_math_answer(answer: str) -> str:
    r"""Simple normalisation so equal answers compare equal as strings: no spaces, `\left`/
    `\right`, `\!`, `$`, trailing ".", degree marks, a trailing `\text{unit}`, or `x=` prefix;
    `dfrac`/`tfrac` -> `frac`; `a/b` and `\frac12` -> `\frac{a}{b}`; `.5` -> `0.5`; `2.0` -> `2`."""
    s = str(answer).strip().replace("\n", "")
    s = s.rstrip(".")
    s = s.replace("\\!", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _UNIT_TEXT.sub("", s).strip() or s
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = s.replace(" ", "")
    s = re.sub(r"(\d),(\d\d\d)(?!\d)", r"\1\2", s)  # 1,000 -> 1000
    s = re.sub(r"^(-?\d+)\.0+$", r"\1", s)  # 2.0 -> 2
    s = _fix_fracs(s)
    s = _fix_a_slash_b(s)
    return s


def math_score(solution_str: str, ground_truth: str) -> float:
    r"""1.0 if the last `\boxed{}` answer in the solution equals the ground truth after
    normalisation (the ground truth may itself be boxed), else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    truth_boxed = last_boxed_only_string(truth)
    if truth_boxed is not None:
        truth = remove_boxed(truth_boxed)
    return 1.0 if normalize_math_answer(remove_boxed(boxed)) == normalize_math_answer(truth) else 0.0


# --------------------------------------------------------------------------------------------
# reasoning-gym tasks (data_source "reasoning_gym/<task>")
# --------------------------------------------------------------------------------------------
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@lru_cache(maxsize=None)
def _rg_score_fn(task: str):
    # Building a task's dataset object is cheap but not free; one per task per process.
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """The task's own `score_answer(answer, entry)`, with the entry rebuilt from
    `extra_info["rg_entry"]` (JSON written by the dataset generator), or from the ground truth
    alone when the row came from elsewhere. The answer is the last `<answer>...</answer>` if the
    response has one (reasoning-gym's convention), else the whole stripped response."""
    info = _as_dict(extra_info)
    task = info.get("rg_task") or data_source.split("/", 1)[-1]
    raw = info.get("rg_entry")
    entry = decode_rg_entry(raw) if isinstance(raw, str) else (raw or {"answer": ground_truth, "metadata": {}})
    entry.setdefault("answer", ground_truth)
    entry.setdefault("metadata", {})
    tagged = _ANSWER_TAG.findall(solution_str)
    answer = tagged[-1].strip() if tagged else solution_str.strip()
    return float(_rg_score_fn(task)(answer, entry))


def _untag(obj: dict) -> Any:
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(obj["__tuple__"])
    if len(obj) == 1 and "__set__" in obj:
        return set(obj["__set__"])
    return obj


def decode_rg_entry(raw: str) -> dict:
    """A reasoning-gym entry stored by `storage.datasets` (JSON with tuples and sets tagged as
    {"__tuple__": [...]} / {"__set__": [...]}) back to the types its score_answer expects."""
    return json.loads(raw, object_hook=_untag)


def _as_dict(extra_info: Any) -> dict:
    if extra_info is None:
        return {}
    if isinstance(extra_info, str):
        try:
            value = json.loads(extra_info)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}
    return dict(extra_info)
