"""Token sequences: the one input every path sees, id for id.

Three sources:

* the probe set: random prompt tokens; the responses are sampled later by the
  inference engine at a fixed seed, exactly as a rollout produces them
  (``random_prompts`` here, sampling in the engine);
* a JSONL file of token ids (``load_jsonl``), optionally with the logprobs the
  RL framework recorded at rollout time (replay mode) and a ``response_mask``
  (0 for tool/observation tokens: replayed, since they condition later tokens,
  but not scored);
* text prompts (``load_text_prompts``), tokenized with MODEL's tokenizer and its
  chat template; their responses are sampled like the probe set's.

Validation against the model (vocabulary, context length) happens in
``validate`` so every source gets the same one-line errors.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from logdiff.errors import InputError
from logdiff.records.untrusted import regular_file


@dataclass
class Sequence:
    """One prompt and its response, as token ids."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] | None = None
    #: one 0/1 per response token; 0: replayed on every path but not scored (None: all scored)
    response_mask: list[int] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def random_prompts(
    num: int, prompt_len: int, vocab_size: int, seed: int, *, avoid: set[int] = frozenset()
) -> list[Sequence]:
    """Prompts of uniformly random token ids; lengths vary a little so batches are ragged."""
    if num < 1 or prompt_len < 1:
        raise InputError("--num-sequences and --prompt-len must be at least 1")
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in avoid]
    out = []
    for i in range(num):
        # Mixed lengths (prompt_len, prompt_len - 1, ...) exercise padding and ragged batches.
        n = max(1, prompt_len - (i % 4))
        out.append(Sequence([rng.choice(allowed) for _ in range(n)]))
    return out


def _int_list(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InputError(f"{where}: '{what}' must be a list of integer token ids")
    return value


#: how far above 0 a recorded logprob may be (rounding in the engine's log_softmax), in nats
LOGPROB_SLACK = 1e-4


def _logprobs(values: list[Any], where: str) -> list[float]:
    """Recorded logprobs as floats: JSON numbers, finite, at most ``LOGPROB_SLACK`` above 0."""
    for i, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            problem = f"is {type(x).__name__} {x!r}, not a number"
        elif not math.isfinite(x):
            problem = f"is {x}, not a finite number"
        elif x > LOGPROB_SLACK:
            problem = f"is {x}, but a logprob is <= 0"
        else:
            continue
        raise InputError(f"{where}: rollout_logprobs at response position {i} {problem}")
    return [float(x) for x in values]


def _response_mask(value: Any, n: int, where: str) -> list[int]:
    """A ``response_mask``: one 0 or 1 per response token, not all 0."""
    if not isinstance(value, list) or len(value) != n:
        raise InputError(f"{where}: 'response_mask' needs one 0 or 1 per response token ({n})")
    bad = next((i for i, x in enumerate(value) if isinstance(x, bool) or x not in (0, 1)), None)
    if bad is not None:
        raise InputError(f"{where}: response_mask at response position {bad} is {value[bad]!r}, not 0 or 1")
    if not any(value):
        raise InputError(f"{where}: 'response_mask' is all 0: no response token would be scored")
    return [int(x) for x in value]


def load_jsonl(path: Path) -> list[Sequence]:
    """Read ``{"prompt_ids": [...], "response_ids": [...], "rollout_logprobs": [...], "response_mask": [...]}``."""
    path = regular_file(path, "sequences file")
    seqs: list[Sequence] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "prompt_ids" not in obj or "response_ids" not in obj:
            raise InputError(f"{where}: each line needs 'prompt_ids' and 'response_ids'")
        prompt = _int_list(obj["prompt_ids"], "prompt_ids", where)
        response = _int_list(obj["response_ids"], "response_ids", where)
        if not prompt or not response:
            raise InputError(f"{where}: 'prompt_ids' and 'response_ids' must not be empty")
        lps = obj.get("rollout_logprobs")
        if lps is not None:
            if not isinstance(lps, list) or len(lps) != len(response):
                raise InputError(f"{where}: 'rollout_logprobs' needs one number per response token")
            lps = _logprobs(lps, f"{where} (sequence {len(seqs)})")
        mask = obj.get("response_mask")
        if mask is not None:
            mask = _response_mask(mask, len(response), where)
        seqs.append(Sequence(prompt, response, lps, mask))
    if not seqs:
        raise InputError(f"{path}: no sequences in file")
    return seqs


def load_text_prompts(path: Path, model_dir: Path, trust_remote_code: bool = False) -> list[Sequence]:
    """Tokenize prompts (plain text lines, or JSONL with ``prompt`` or chat ``messages``)."""
    path = regular_file(path, "prompts file")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is the user's model dir
        raise InputError(f"--prompts needs a tokenizer in {model_dir}: {type(e).__name__}: {e}") from None
    seqs = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj: Any = line
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if isinstance(obj, dict) and "messages" in obj:
            if not getattr(tok, "chat_template", None):
                raise InputError(f"{path}:{lineno}: chat 'messages' need a chat template in {model_dir}")
            ids = _chat_ids(tok, obj["messages"], f"{path}:{lineno}")
        else:
            text = obj["prompt"] if isinstance(obj, dict) and "prompt" in obj else obj
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: expected a 'prompt' string or 'messages'")
            ids = tok(text)["input_ids"]
        seqs.append(Sequence([int(t) for t in ids]))
    if not seqs:
        raise InputError(f"{path}: no prompts in file")
    return seqs


def _chat_ids(tok: Any, messages: Any, where: str) -> list[int]:
    """Token ids of chat ``messages`` (a list of ``{"role": str, "content": str | list}``)."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: 'messages' must be a non-empty list of role/content objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise InputError(f"{where}: messages[{i}] needs a string 'role' and a 'content'")
        if not isinstance(m["content"], (str, list)):
            raise InputError(f"{where}: messages[{i}].content must be a string or a list of parts")
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - the template is the model's code: any error is about this input
        raise InputError(f"{where}: the chat template cannot render these messages ({type(e).__name__}: {e})") from None
    if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def validate(
    seqs: list[Sequence], vocab_size: int, max_len: int, response_len: int = 0, limit: str = "max_position_embeddings"
) -> None:
    """One-line errors for ids outside the vocabulary and sequences longer than the context."""
    for i, s in enumerate(seqs):
        bad = [t for t in s.ids if t < 0 or t >= vocab_size]
        if bad:
            raise InputError(
                f"sequence {i}: token id {bad[0]} is outside the model's vocabulary (size {vocab_size})"
            )
        total = len(s) + (0 if s.response_ids else response_len)
        if total > max_len:
            raise InputError(
                f"sequence {i}: {total} tokens exceed the model's context of {max_len} ({limit})"
            )
