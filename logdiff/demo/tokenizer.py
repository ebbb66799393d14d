"""A small byte-level BPE tokenizer for the demo models, trained locally.

Byte-level BPE (the GPT-2 / Qwen / Llama-3 scheme) covers every string, so
any prompt a user types tokenizes without unknown tokens. It is trained with
the ``tokenizers`` package on the demo corpus (see ``corpus.py``) in about a
second. Training is deterministic for a given text.

Vocabulary: ``DEMO_VOCAB_SIZE`` = 4096 ids, the special tokens first:

| id | token             | role                                  |
|----|-------------------|---------------------------------------|
| 0  | ``<|pad|>``       | padding                               |
| 1  | ``<|bos|>``       | beginning of sequence (never added automatically) |
| 2  | ``<|endoftext|>`` | end of a document                     |
| 3  | ``<|im_start|>``  | chat: start of a message              |
| 4  | ``<|im_end|>``    | chat: end of a message; the eos token |

then the 256 byte symbols, then the learned merges. The chat template is
ChatML, as in Qwen. It is saved as a ``transformers`` fast tokenizer
(``tokenizer.json`` + ``tokenizer_config.json`` with the chat template), so
``AutoTokenizer.from_pretrained(model_dir)`` loads it for every demo arch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DEMO_VOCAB_SIZE = 4096
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOT_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOT_TOKEN, IM_START, IM_END)
EOS_TOKEN = IM_END

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEMO_VOCAB_SIZE):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with the demo special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def special_token_ids(tokenizer) -> dict[str, int]:
    """The id of each special token, by name (pad, bos, eot, im_start, im_end, eos)."""
    ids = {name: tokenizer.token_to_id(tok) for name, tok in
           (("pad", PAD_TOKEN), ("bos", BOS_TOKEN), ("eot", EOT_TOKEN),
            ("im_start", IM_START), ("im_end", IM_END))}
    ids["eos"] = ids["im_end"]
    return ids


def encode_chat_document(tokenizer, user: str, assistant: str) -> list[int]:
    """Token ids of one training document in the chat format, ending with ``<|endoftext|>``.

    The pieces between special tokens are encoded separately, exactly as the
    chat template followed by tokenization splits them; a literal special
    token string inside ``assistant`` is therefore never read as a special token.
    """
    sp = special_token_ids(tokenizer)
    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids if text else []
    return ([sp["im_start"]] + enc(f"user\n{user}") + [sp["im_end"]] + enc("\n")
            + [sp["im_start"]] + enc("assistant\n") + _encode_plain(tokenizer, assistant)
            + [sp["im_end"]] + enc("\n") + [sp["eot"]])


def _encode_plain(tokenizer, text: str) -> list[int]:
    """Encode ``text`` so that special-token strings inside it stay ordinary text."""
    out: list[int] = []
    pos = 0
    while True:  # split at any literal special token and encode it byte by byte
        hits = [(text.find(tok, pos), tok) for tok in SPECIAL_TOKENS]
        hits = [(i, tok) for i, tok in hits if i >= 0]
        end = min(hits)[0] if hits else len(text)
        if end > pos:
            out += tokenizer.encode(text[pos:end], add_special_tokens=False).ids
        if not hits:
            return out
        i, tok = min(hits)
        for ch in tok:  # '<', '|', ... each through the byte-level model
            out += tokenizer.encode(ch, add_special_tokens=False).ids
        pos = i + len(tok)


def to_transformers(tokenizer, model_max_length: int = 2048) -> Any:
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[EOT_TOKEN, IM_START],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(tokenizer, directory: Path, model_max_length: int = 2048) -> None:
    """Save ``tokenizer`` so that ``AutoTokenizer.from_pretrained(directory)`` loads it."""
    hf = to_transformers(tokenizer, model_max_length=model_max_length)
    hf.save_pretrained(str(directory))


def encode_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Plain (non-chat) token ids of each text, without special tokens."""
    return [_encode_plain(tokenizer, t) for t in texts]
