"""Build the embedded demo's tiny model and tokenizer locally, in Hugging Face format.

No hub access: a character-level tokenizer over the task's alphabet and a small
randomly initialised Qwen2 are written with `save_pretrained`, which both
`transformers` and vLLM load. head_dim is 64 because vLLM's CPU attention kernel
accepts only some head sizes (16 fails with "Unsupported CPU attention configuration").
"""

from __future__ import annotations

from pathlib import Path

ALPHABET = "0123456789+-=*() "
SPECIALS = ["<pad>", "<eos>", "<bos>"]
# The tool demo's tags (configs/demo_tools.toml, actors/env/demo.py): each one token, after the alphabet's ids
TOOL_TAGS = ["<calc>", "</calc>", "<result>", "</result>", "<error>", "</error>"]


def build_tokenizer(tags: list[str] | None = None):
    """The character tokenizer; `tags`: whole-word tokens besides (the tool demo's), ids after the characters'.

    The tags are added tokens, matched before the character split by whichever tokenizer class loads the folder
    (AutoTokenizer reads a Qwen2 model's as Qwen2's fast tokenizer, whose own pre-tokenizer would split them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", model_max_length=256)
    if tags:
        fast.add_tokens(tags)
    return fast


def build_model(vocab_size: int, seed: int, hidden: int = 128, layers: int = 2, heads: int = 2):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=SPECIALS.index("<bos>"),
        eos_token_id=SPECIALS.index("<eos>"),
        pad_token_id=SPECIALS.index("<pad>"),
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def write_tiny_model(out: Path, seed: int = 0, tags: list[str] | None = None) -> Path:
    """Create a randomly initialised tiny model folder at `out`; returns its absolute path."""
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tags)
    model = build_model(len(tokenizer), seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
