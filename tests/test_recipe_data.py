"""Recipe data: the offline tokenizers are GPT-2's and BERT's, and batches are a pure function of the step."""

import torch

from moe_plugins.recipes import data


def test_gpt2_bpe_is_gpt2s(tmp_path):
    tok = data.gpt2_tokenizer(tmp_path)
    assert len(tok) == 50257
    assert tok("Hello world")["input_ids"] == [15496, 995]


def test_bert_wordpiece_is_bert_base_uncased(tmp_path):
    tok = data.bert_tokenizer(tmp_path)
    assert len(tok) == 30522
    assert tok("Hello world")["input_ids"] == [101, 7592, 2088, 102]
    assert tok.mask_token_id == 103


def test_packaged_corpus_and_deterministic_batches(tmp_path):
    files = data.corpus_files()
    assert len(files) == 42
    text = data.read_corpus(files, max_chars=50_000)
    assert "thou" in text.lower()
    blocks = data.TokenBlocks.from_text(text, data.gpt2_tokenizer(tmp_path), seq_len=32)
    a = blocks.batches(step=5, batch_size=2, dp_rank=1, dp_size=4, seed=3)
    assert torch.equal(a, blocks.batches(step=5, batch_size=2, dp_rank=1, dp_size=4, seed=3))
    others = [blocks.batches(step=5, batch_size=2, dp_rank=r, dp_size=4, seed=3) for r in (0, 2, 3)]
    assert all(not torch.equal(a, o) for o in others)      # ranks see different data
    assert a.shape == (2, 32)


def test_mask_tokens_follows_bert_rule(tmp_path):
    tok = data.bert_tokenizer(tmp_path)
    ids = torch.randint(1000, 2000, (64, 64))
    inputs, labels = data.mask_tokens(ids, tok, 0.15, torch.Generator().manual_seed(0))
    target = labels != -100
    assert 0.12 < target.float().mean() < 0.18
    assert torch.equal(labels[target], ids[target])
    masked = (inputs == tok.mask_token_id)
    assert masked[~target].sum() == 0 and 0.7 < masked[target].float().mean() < 0.9


def test_the_tokenizer_cache_files_appear_whole(tmp_path, monkeypatch):
    """The ranks of a job fill one cache at once, and a rank that finds a vocabulary file must read all of it (a
    half-written BERT vocab.txt lost [UNK] for one rank of a CI run): every file is written under another name and
    renamed into place, so the final names are never written to; a second call reads what the first published."""
    from pathlib import Path
    written = []
    write_bytes = Path.write_bytes
    monkeypatch.setattr(Path, "write_bytes", lambda self, content: written.append(self.name) or
                        write_bytes(self, content))
    data.bert_tokenizer(tmp_path)
    data.gpt2_tokenizer(tmp_path)
    assert len(written) == 3 and not {"vocab.txt", "vocab.json", "merges.txt"} & set(written), written
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["merges.txt", "vocab.json", "vocab.txt"]
    assert len(data.bert_tokenizer(tmp_path)) == 30522 and len(written) == 3
