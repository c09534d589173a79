"""Stage 2 with a base model's own HF tokenizer (continued pretraining): its ids, its BOS where its tokenizer
adds one, its EOS between documents, int32 ids above uint16's range, on the man-page corpus. The tokenizers
are trained here with the `tokenizers` library (no hub): a byte-level BPE as GPT-2/Llama 3/Qwen use."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import SHIFT, byte_level_bpe, corpus_texts, run_cli

from gptpipe.cli import main
from gptpipe.data.indexed import UINT16_VOCAB_LIMIT, bin_path
from gptpipe.artifacts import EXIT_BAD_INPUT, TOKENIZE

def documents(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix), mmap=True)
    return [np.array(dataset[i]) for i in range(len(dataset))]  # copies: the mmap closes with the dataset


@pytest.mark.parametrize("adds_bos", [False, True], ids=["eos-only", "bos-and-eos"])
def test_a_base_models_tokenizer_gives_its_own_ids_and_document_boundaries(adds_bos: bool, corpus_dir: Path,
                                                                             workspace: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    texts = corpus_texts(corpus_dir)
    folder = byte_level_bpe(texts, tmp_path / "base", adds_bos, shift=SHIFT if not adds_bos else 0)
    prefix = tmp_path / "data" / "base"
    run_cli("tokenize", "--config", workspace / "config.yaml", f"tokenize.tokenizer_dir={folder}",
            f"tokenize.output_prefix={prefix}", "tokenize.workers=2")
    prefix = prefix.with_name("base_text_document")

    reference = AutoTokenizer.from_pretrained(folder)
    got = documents(prefix)
    assert len(got) == len(texts)
    for i in range(0, len(texts), 25):  # every 25th document: the ids transformers gives, between BOS and EOS
        expected = reference(texts[i])["input_ids"] + [reference.eos_token_id]
        assert got[i].tolist() == expected, f"document {i} differs"
        assert (got[i][0] == reference.bos_token_id) == adds_bos
    counts = TOKENIZE.require(prefix).counts
    assert counts["boundaries"] == {"tokenizer": "hf", "bos_id": reference.bos_token_id if adds_bos else None,
                                    "eod_id": reference.eos_token_id, "vocab_size": len(reference),
                                    "tokenizer_sha256": hashlib.sha256((folder / "tokenizer.json").read_bytes())
                                    .hexdigest(), "tokenizer_class": "TokenizersBackend",
                                    "encoder_sha256": hashlib.sha256(reference.backend_tokenizer.to_str().encode())
                                    .hexdigest(), "rebuilt": None}
    if adds_bos:
        assert counts["dtype"] == "uint16"
    else:  # a vocabulary past uint16's range: int32 on disk, and ids above it really occur
        assert counts["dtype"] == "int32" and len(reference) > UINT16_VOCAB_LIMIT
        assert max(int(doc.max()) for doc in got) >= UINT16_VOCAB_LIMIT
        assert bin_path(prefix).stat().st_size == 4 * counts["tokens"]


def test_the_stage_1_tokenizers_hf_folder_writes_the_same_dataset(dataset_prefix: Path, tokenizer_dir: Path,
                                                                  workspace: Path, tmp_path: Path) -> None:
    """Through the `tokenizers` path, gptpipe's own fast tokenizer (identical ids, no BOS) gives byte for byte
    the dataset that the SentencePiece path wrote."""
    prefix = tmp_path / "via_hf"
    run_cli("tokenize", "--config", workspace / "config.yaml", f"tokenize.tokenizer_dir={tokenizer_dir / 'hf'}",
            f"tokenize.output_prefix={prefix}")
    assert bin_path(prefix.with_name("via_hf_text_document")).read_bytes() == bin_path(dataset_prefix).read_bytes()


def test_a_tokenizer_without_eos_is_refused_naming_the_key(corpus_dir: Path, workspace: Path, tmp_path: Path,
                                                           capfd) -> None:
    folder = byte_level_bpe(corpus_texts(corpus_dir), tmp_path / "no-eos", adds_bos=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    code = main(["tokenize", "--config", str(workspace / "config.yaml"), f"tokenize.tokenizer_dir={folder}",
                 f"tokenize.output_prefix={tmp_path / 'out'}"])
    assert code == EXIT_BAD_INPUT
    assert f"tokenize.tokenizer_dir {folder}: the tokenizer has no EOS token" in capfd.readouterr().err
    assert not list(tmp_path.glob("out*"))
