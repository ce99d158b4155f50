"""Tokenization: GGUF / HF-folder tokenizers, chat templates and streaming detokenization."""
from tokenloom.tokenizer.chat_template import ChatTemplateError, render_chat_template
from tokenloom.tokenizer.detokenizer import IncrementalDetokenizer
from tokenloom.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "render_chat_template",
]
