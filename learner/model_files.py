"""The model folder (model.path, algo.critic_path) checked before anything loads from it, with errors that say
what to do.

Without these checks a wrong path reaches `transformers`, which takes any string that is not a folder for a hub
repo id and fails with "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"; a folder without
tokenizer files even loads, as an empty tokenizer (one token), and fails later with "tokenizes to no tokens".
model.path is a local folder by design: the learner and every actor's engine must load the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protocol.config import Config, ConfigError
from protocol.logs import first_line

# Any of these makes a folder's tokenizer loadable by AutoTokenizer (fast, sentencepiece, BPE or WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
_FIX = "point it at a local Hugging Face model folder (save_pretrained's output; deploy/tiny.py writes a tiny one)"


def check_model_dir(path: str, name: str = "model.path", tokenizer: bool = True) -> Path:
    """`path` is a folder with a config.json (and, with `tokenizer`, tokenizer files); ConfigError naming `name`."""
    if not path:
        raise ConfigError(f"{name}: empty; {_FIX} (`fleetrl demo` builds one when model.path is empty)")
    folder = Path(path).expanduser()
    if not folder.exists():
        hint = ""
        if not folder.is_absolute() and path.count("/") == 1 and not path.startswith("."):
            hint = f", or download the hub model there first: huggingface-cli download ORG/NAME --local-dir {path}"
        raise ConfigError(f"{name}: {path}: no such folder (from {Path.cwd()}); {_FIX}{hint}")
    if not folder.is_dir():
        raise ConfigError(f"{name}: {path} is a file; {_FIX}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{name}: {path} has no config.json, so it is not a Hugging Face model folder; {_FIX}")
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"{name}: {path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); save the model's "
            f"tokenizer there too: AutoTokenizer.from_pretrained(ORIGINAL).save_pretrained('{path}')"
        )
    return folder


def check_model_paths(cfg: Config) -> None:
    """Every model folder the run will load: the policy (learner and actors), and the critic when one is set."""
    check_model_dir(cfg.model.path)
    if cfg.algo.advantage == "gae" and cfg.algo.critic_path:
        check_model_dir(cfg.algo.critic_path, "algo.critic_path", tokenizer=False)


def load_tokenizer(path: str, name: str = "model.path") -> Any:
    """The folder's tokenizer; ConfigError naming `name` when the folder or its files are wrong."""
    from transformers import AutoTokenizer

    check_model_dir(path, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:  # transformers' errors for unreadable or mismatched files
        raise ConfigError(
            f"{name}: the tokenizer in {path} does not load ({first_line(e)}); re-save it with tokenizer.save_pretrained"
        ) from e
    if len(tokenizer) < 2:
        raise ConfigError(f"{name}: the tokenizer in {path} has {len(tokenizer)} token(s); re-save it with tokenizer.save_pretrained")
    return tokenizer


def load_model_config(path: str, name: str = "model.path") -> Any:
    """The folder's transformers config (config.json only: no weights are read)."""
    from transformers import AutoConfig

    check_model_dir(path, name, tokenizer=False)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:  # unknown model_type, malformed JSON
        raise ConfigError(f"{name}: {path}/config.json does not load ({first_line(e)})") from e
