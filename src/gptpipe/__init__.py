"""gptpipe: raw text → SentencePiece → Megatron indexed data → DeepSpeed GPT → verified HuggingFace model."""

__version__ = "0.1.0"
